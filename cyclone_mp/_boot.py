"""How the supervisor's helper processes start: ``python -S -P .../cyclone_mp/_boot.py cyclone_mp.MODULE ARGS...``.

A child must start fast, and an editable install of this project (``pip install -e .``)
is an import hook that imports ``pathlib`` at every interpreter start (about 12 ms). So
the supervisor starts its helpers without site processing (``-S``) and this script
rebuilds, from ``CYCLONE_MP_SITE`` (JSON written by :func:`cyclone_mp.procs.child_site`),
what ``site`` had given the supervisor: ``sys.path`` exactly as the supervisor's (in the
same order), the import lines of every ``.pth`` file but this project's own editable
finder, ``sitecustomize`` / ``usercustomize`` when the supervisor had imported them,
``sys.prefix`` / ``sys.exec_prefix`` and the builtins site adds (``exit``, ``help``...).

Then ``cyclone_mp.MODULE`` is imported (the package from beside this file, whichever way
it is installed) and its ``main(ARGS)`` runs; ``ps`` shows the module's full name. Only
``os`` and ``sys`` are imported before the site is rebuilt.
"""

import os
import sys


def rebuild_site(spec: dict) -> None:
    """Make this ``-S`` interpreter's import system the supervisor's (see the module docstring)."""
    sys.path[:] = spec["path"]
    sys.prefix, sys.exec_prefix = spec["prefix"], spec["exec_prefix"]
    import site  # under -S importing site runs nothing; its helpers add the builtins

    site.setquit()
    site.setcopyright()
    site.sethelper()
    for line in spec["pth"]:
        try:
            exec(line)  # noqa: S102 - what site itself runs for an "import" line of a .pth file
        except Exception:  # noqa: BLE001 - site reports and carries on, so do we
            pass
    for name in spec["custom"]:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001
            pass


def main() -> None:
    import json  # lazy: the child's first module imports only what it runs

    rebuild_site(json.loads(os.environ.get("CYCLONE_MP_SITE") or "null") or {
        "path": sys.path, "prefix": sys.prefix, "exec_prefix": sys.exec_prefix, "pth": [], "custom": []})
    module, args = sys.argv[1], sys.argv[2:]
    if not module.startswith("cyclone_mp."):
        raise SystemExit(f"_boot.py: not a cyclone_mp module: {module}")
    sys.argv[1:] = args  # as ``python -m cyclone_mp.MODULE ARGS`` would show them
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    added = root not in sys.path
    if added:  # an editable install: the package is found beside this file, for this import only
        sys.path.append(root)
    try:
        target = __import__(module, fromlist=["main"])
    finally:
        if added:
            sys.path.remove(root)  # (the package's submodules resolve through its __path__)
    target.main(args)


if __name__ == "__main__":
    main()
