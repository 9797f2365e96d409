"""The GPU path: the FFI handler XLA calls, and the cuBLASLt plans it runs.

``ffi`` is the only module that knows XLA's FFI ABI and the only way into ``plan``, the
only module that imports nvmath-python. ``operands`` lays out each problem for planning,
``tuning`` times cuBLASLt's candidates and ``replay`` relaunches captured graphs; both use
CuPy only. Importing this package (or ``ffi``) touches neither the GPU nor nvmath.
"""
