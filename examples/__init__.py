"""Example apps for the README tour (``cyclone-mp worker examples.app:mux``)."""
