"""The ``cyclone-mp`` command line, importable as ``cyclone_mp_cli`` (pyproject maps this
folder to that name). ``main.py`` holds the click commands, ``render.py`` the rich output,
``params.py`` the option types. No SQL or process logic lives here: every command calls
one library function of :mod:`cyclone_mp`.
"""
