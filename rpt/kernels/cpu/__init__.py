"""The CPU backend: rpt's C++ time loops (build.py builds them, once per machine) and the products of
products.py."""
