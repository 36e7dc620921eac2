"""C sources of the native kernels, installed as package data (``minirt._native_src``) so an
installed copy without a prebuilt extension can still compile them on first use."""
