"""Per-step resource caps, end to end: declared, held, sampled, and judged at death.

- ``declared``: the caps a step declares (``Limits``), sizes and counts.
- ``confinement``: the mechanism a supervisor chose (said by ``mechanism``) and its slots;
  ``slot``: one slot's cgroups, caps and kill, through ``cgroup_v2`` or ``cgroup_v1``
  (one interface: ``cgroup_version``); ``cgroups``: the host's cgroups.
- Without cgroups: ``rlimits`` (set by the child) and ``userns`` (a user namespace per
  child, for ``max_processes``).
- Sampling: ``sampling``, ``proctree``, ``procfs``; the running attempts: ``watch``.
- Cause of death: ``verdicts``, with the kernel's word on OOM kills (``kmsg``).

This file imports nothing: the child runner imports its few modules here without the rest.
"""
