"""Per-step resource caps, end to end: declared, held, sampled, and judged at death.

- :mod:`~cyclone_mp.limits.declared`: the caps a step declares (:class:`Limits`), sizes, counts.
- :mod:`~cyclone_mp.limits.confinement`: the mechanism a supervisor chose, its slots;
  :mod:`~cyclone_mp.limits.mechanism` says it in words.
- :mod:`~cyclone_mp.limits.slot`: one child slot's cgroups, caps and kill, through
  :mod:`~cyclone_mp.limits.cgroup_v2` or :mod:`~cyclone_mp.limits.cgroup_v1`
  (one interface: :mod:`~cyclone_mp.limits.cgroup_version`); the host's cgroups: :mod:`~cyclone_mp.limits.cgroups`.
- Without cgroups: :mod:`~cyclone_mp.limits.rlimits` (set by the child) and
  :mod:`~cyclone_mp.limits.userns` (a user namespace per child, for ``max_processes``).
- Sampling: :mod:`~cyclone_mp.limits.sampling`, :mod:`~cyclone_mp.limits.proctree`,
  :mod:`~cyclone_mp.limits.procfs`; the running attempts watched: :mod:`~cyclone_mp.limits.watch`.
- Cause of death: :mod:`~cyclone_mp.limits.verdicts`, with the kernel's word on OOM kills
  (:mod:`~cyclone_mp.limits.kmsg`).

This file imports nothing: the child runner imports its few modules here without the rest.
"""
