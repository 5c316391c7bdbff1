"""The ``cyclone-mp`` command line, importable as ``cyclone_mp_cli`` (pyproject maps this
folder to that name). ``main.py`` holds the group and the commands that run things
(``worker``, ``migrate``, ``enqueue``, ``db``, ``demo``, ``dashboard``), ``runs.py`` those
that read runs and act on them, ``common.py`` what they share, ``render.py`` the rich
output, ``params.py`` the option types. No SQL or process logic lives here: every command calls
one library function of :mod:`cyclone_mp`.
"""
