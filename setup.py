"""Build of the `specdec_inductor._C` extension.

ISA-specific translation units (`csrc/*_avx2.cpp`, `csrc/*_avx512.cpp`, `csrc/*_avx512vnni.cpp`,
`csrc/*_amx.cpp`) are compiled into
static libraries with their own flags and linked into one extension; the runtime picks a path
from CPU feature detection (csrc/cpu_features.cpp). Nothing is built with `-march=native`.
ISA translation units include no ATen headers: they expose plain functions over raw pointers,
so no inline function compiled for a wider ISA can leak into the portable code.
"""
import glob
import os
import subprocess
import tempfile

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
# The C++ standard is left to torch (it adds the one its headers need) for the main extension.
COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-strict-aliasing"]
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
               "-mf16c"],
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
            "-mf16c", "-mamx-tile", "-mamx-bf16"],
    # Units called only after cpu_has_avx512_vnni() (AVX-512 CPUs without VNNI: Skylake-X).
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma",
                   "-mf16c"],
}


def _compiler_accepts(flags):
    """True when the C++ compiler accepts `flags` (old compilers lack AMX)."""
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write("int main() { return 0; }\n")
        cmd = [cxx, *flags, "-c", src, "-o", os.path.join(tmp, "probe.o")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


isa_sources = {isa: _rel(glob.glob(os.path.join(ROOT, "csrc", f"*_{isa}.cpp"))) for isa in ISA_FLAGS}
portable_sources = [
    s for s in _rel(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))
    if not any(s in srcs for srcs in isa_sources.values())
]

isa_objects = {}  # isa -> (sources, flags), compiled by BuildWithIsaUnits
macros = []
for isa, sources in isa_sources.items():
    if not sources:
        continue
    if not _compiler_accepts(ISA_FLAGS[isa]):
        print(f"specdec_inductor: compiler lacks {isa} flags; the {isa} path is not built")
        continue
    isa_objects[isa] = (sources, ["-O3", "-std=c++17", "-fPIC", *ISA_FLAGS[isa]])
    macros.append((f"SPECDEC_BUILT_{isa.upper()}", "1"))


class BuildWithIsaUnits(BuildExtension):
    """Compiles each ISA's translation units with that ISA's flags, then links them in."""

    def build_extensions(self):
        for ext in self.extensions:
            for isa, (sources, flags) in isa_objects.items():
                ext.extra_objects += self.compiler.compile(
                    sources, output_dir=os.path.join(self.build_temp, isa),
                    include_dirs=[os.path.join(ROOT, "csrc")], extra_postargs=flags)
        super().build_extensions()


setup(
    ext_modules=[
        CppExtension(
            "specdec_inductor._C",
            portable_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=macros,
            extra_compile_args={"cxx": COMMON_FLAGS},
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildWithIsaUnits},
)
