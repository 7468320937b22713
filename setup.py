"""Build the Cython kernels: every ngramspec/*.pyx becomes one extension module.

NGRAMSPEC_DEBUG=1 turns Cython's bounds, wraparound and initialization checks back on (the test
suite runs once that way); NGRAMSPEC_ASAN=1 adds AddressSanitizer instrumentation.
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("NGRAMSPEC_DEBUG") == "1"
ASAN = os.environ.get("NGRAMSPEC_ASAN") == "1"
CPP_MODULES = {"_cache", "_suffix"}  # these use libcpp containers
# NGRAMSPEC_ONLY=_engine,_cache builds just those modules (a quicker rebuild while developing).
ONLY = set(filter(None, os.environ.get("NGRAMSPEC_ONLY", "").split(",")))

compile_args = ["-O3"] if not ASAN else ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
link_args = ["-fsanitize=address"] if ASAN else []

extensions = []
for path in sorted(glob.glob("ngramspec/*.pyx")):
    name = os.path.splitext(os.path.basename(path))[0]
    if ONLY and name not in ONLY:
        continue
    cpp = name in CPP_MODULES
    extensions.append(Extension(
        f"ngramspec.{name}", [path],
        include_dirs=[numpy.get_include(), "ngramspec"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args + (["-std=c++17"] if cpp else []),
        extra_link_args=link_args,
        language="c++" if cpp else "c",
    ))

directives = {
    "language_level": 3, "embedsignature": True, "cdivision": True,
    "boundscheck": DEBUG, "wraparound": DEBUG, "initializedcheck": DEBUG,
}
setup(ext_modules=cythonize(extensions, compiler_directives=directives))
