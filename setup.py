"""The one compiled part of Brownout: `proxy.openai._runscan` (C, no
dependencies), the scanner behind `proxy.openai.chunkrun` on long streams.

Optional: where no C compiler exists the build goes on without it and the
proxy uses the pure-Python scanner (`brownout --version` says which one
runs). Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.openai._runscan",
            ["proxy/openai/_runscan.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
