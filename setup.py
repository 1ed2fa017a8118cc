"""The optional C extensions (fast paths of the kernel loop and the DBO primitives); everything
else is in pyproject.toml.

``optional=True``: where they cannot be compiled (no C compiler), the install goes on and asyncdbo
runs its pure-Python kernel loop and primitives, which stay the reference (set
``ASYNCDBO_PURE_PYTHON=1`` to run them where the extensions are built; see
asyncdbo/_core/extensions.py for the switch of each extension). Both include the shared slot
helpers in asyncdbo/_native/slots.h (listed in MANIFEST.in, so an sdist carries it)."""

from setuptools import Extension, setup

NATIVE = "asyncdbo/_native"
HEADERS = [f"{NATIVE}/slots.h"]

setup(
    ext_modules=[
        Extension("asyncdbo._core._spin", ["asyncdbo/_core/_spin.c"], include_dirs=[NATIVE], depends=HEADERS,
                  optional=True),
        Extension("asyncdbo.dbo._speedups", ["asyncdbo/dbo/_speedups.c"], include_dirs=[NATIVE], depends=HEADERS,
                  optional=True),
    ]
)
