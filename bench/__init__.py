"""The benchmarks, installed as `kvmesh.bench` (pyproject's package-dir maps this folder there).

`kvmesh bench <name>` runs the modules with a command line (serve, offline, router, autoscale, fuzz:
each has ``add_args(parser)`` and ``run(args)``, and `kvmesh.commands.bench` imports one only when
it is chosen). The other files are scripts, run as ``python bench/<file>.py`` (the GPU ones on a
machine with a GPU). They measure the product from outside, as a user would: the product imports
nothing from here (tests/unit/test_import_boundaries.py), so a benchmark's needs never shape it.
"""
