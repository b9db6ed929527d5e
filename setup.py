"""Builds fusedops' native libraries by driving CMakeLists.txt, and records how they were built.

Switches (environment variables):
    FUSEDOPS_CUDA         auto (default, also when empty): build the CUDA kernels when torch is a
                          CUDA build and a CUDA compiler is found; 1: require them; 0: skip them.
    TORCH_CUDA_ARCH_LIST  e.g. "9.0" or "8.0;9.0;10.0+PTX": MAJOR.MINOR, "a" for arch-specific
                          code, "+PTX" to add PTX; ";" or spaces between (default: the visible
                          GPUs, else 9.0).
    MAX_JOBS              parallel compile jobs.
    FUSEDOPS_DEBUG=1      a debug build (-g, no optimisation); release otherwise.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
PY_LIMITED_API = "cp310"
CUDA_MODES = ("auto", "0", "1")
# One TORCH_CUDA_ARCH_LIST item. fusedops._native.ARCH_ITEM reads the recorded list at import
# time to tell whether the GPU has code; the two must accept the same forms, or a build would
# record a list that the check cannot read (tests/test_tooling.py compares them).
ARCH_ITEM = re.compile(r"(\d+)\.(\d+)(a?)(\+PTX)?")


def _cuda_compiler():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    # `nvcc` on PATH may be a wrapper script; the toolkit root is where the real one lives.
    text = Path(nvcc).read_text(errors="ignore") if Path(nvcc).stat().st_size < 4096 else ""
    m = re.search(r"(/\S+/bin/nvcc)\b", text)
    return m.group(1) if m and Path(m.group(1)).exists() else nvcc


def _cuda_mode():
    """FUSEDOPS_CUDA: "auto", "0" or "1"; unset or empty means auto."""
    raw = os.environ.get("FUSEDOPS_CUDA", "")
    mode = raw.strip().lower() or "auto"
    if mode not in CUDA_MODES:
        # A typo must not quietly become auto: the build would then skip (or try) CUDA unasked.
        raise RuntimeError(f"fusedops: FUSEDOPS_CUDA must be one of {', '.join(CUDA_MODES)} "
                           f"(unset or empty: auto), got {raw!r}")
    return mode


def _want_cuda(torch):
    mode = _cuda_mode()
    if mode == "0":
        return False, None
    nvcc = _cuda_compiler()
    if not torch.version.cuda or nvcc is None:
        if mode == "1":
            raise RuntimeError(
                f"FUSEDOPS_CUDA=1 but torch {torch.__version__} has CUDA {torch.version.cuda!r} "
                f"and the CUDA compiler is {nvcc!r}: install a CUDA build of torch and set CUDA_HOME"
            )
        return False, None
    return True, nvcc


def _cmake_archs(spec):
    """A TORCH_CUDA_ARCH_LIST value ("8.0;9.0+PTX") as CMake architectures ("80-real;90");
    an item outside the accepted forms is an error that lists them."""
    archs = []
    for item in re.split(r"[;\s]+", spec.strip()):
        if not item:
            continue
        m = ARCH_ITEM.fullmatch(item)
        if m is None:
            raise RuntimeError(
                f"fusedops: TORCH_CUDA_ARCH_LIST={spec!r}: cannot read {item!r}. Write each GPU "
                'architecture as its compute capability MAJOR.MINOR ("8.0", "9.0"), optionally with '
                '"a" for arch-specific code ("9.0a") and/or "+PTX" to add PTX ("9.0+PTX"), separated by '
                '";" or spaces, e.g. "8.0;9.0;10.0+PTX" (not "90", "sm_90" or a name such as "Hopper")'
            )
        major, minor, arch_specific, ptx = m.groups()
        # CMake: "90-real" is machine code only, "90" machine code and PTX.
        archs.append(f"{major}{minor}{arch_specific}" + ("" if ptx else "-real"))
    if not archs:
        raise RuntimeError(f"fusedops: TORCH_CUDA_ARCH_LIST={spec!r} names no architecture")
    return ";".join(archs)


def _cuda_archs(torch):
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX") as CMake architectures ("80-real;90")."""
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not spec:
        caps = set()
        try:
            if torch.cuda.is_available():
                caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        except Exception:  # no driver on a build machine: fall back to the default below
            caps = set()
        spec = ";".join(f"{a}.{b}" for a, b in sorted(caps)) or "9.0"
    return spec, _cmake_archs(spec)


class CMakeBuild(build_ext):
    """Configures and builds CMakeLists.txt once, then places each library where setuptools
    expects the extension of the same name."""

    # Whether the libraries go into the checkout (an editable install, or build_ext --inplace),
    # where the build record then goes too; a wheel's build leaves the checkout's record alone
    # (it belongs to the editable install the checkout may also serve).
    into_source = False

    def run(self):
        # (build_ext.run clears inplace while it builds; editable_mode is setuptools' flag for
        # a PEP 660 editable install)
        self.into_source = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def build_extensions(self):
        import torch

        build_cuda, nvcc = _want_cuda(torch)
        build_dir = Path(self.build_temp).resolve() / "cmake"
        out_dir = build_dir / "lib"
        build_type = "Debug" if os.environ.get("FUSEDOPS_DEBUG") == "1" else "Release"
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DFUSEDOPS_CUDA={'1' if build_cuda else '0'}",
        ]
        arch_spec = ""
        if build_cuda:
            arch_spec, archs = _cuda_archs(torch)
            args += [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        ninja = _tool("ninja")
        if ninja:
            args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        cmake = _tool("cmake")
        if cmake is None:
            raise RuntimeError("fusedops: building needs cmake >= 3.26 (pip install cmake)")
        build_dir.mkdir(parents=True, exist_ok=True)
        subprocess.check_call([cmake, "-S", str(ROOT), "-B", str(build_dir), *args])
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.check_call([cmake, "--build", str(build_dir), "--parallel", jobs])

        self.extensions = [e for e in self.extensions if build_cuda or e.name != "fusedops._C_cuda"]
        for ext in self.extensions:
            name = ext.name.split(".")[-1]
            built = next(out_dir.glob(f"{name}.*so"))
            dest = Path(self.get_ext_fullpath(ext.name))
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built, dest)
        self._write_build_info(torch, build_cuda, nvcc, arch_spec, build_type, build_dir)

    def _write_build_info(self, torch, build_cuda, nvcc, arch_spec, build_type, build_dir):
        nvcc_version = ""
        if build_cuda:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
            m = re.search(r"release (\d+\.\d+)", out)
            nvcc_version = m.group(1) if m else ""
        cxx_path = _cmake_cxx_compiler(build_dir)
        info = {
            "torch": torch.__version__.split("+")[0],
            "torch_cuda": torch.version.cuda or "",
            "torch_target": "2.10",
            "cuda_built": build_cuda,
            "cuda_compiler": nvcc_version,
            "cuda_archs": arch_spec,
            "cxx_compiler": _first_version_line(cxx_path),
            "cxx_compiler_path": cxx_path,
            "build_type": build_type,
        }
        text = '"""Written by setup.py: how the native libraries of this install were built."""\n\nBUILD_INFO = {\n'
        text += "".join(f"    {k!r}: {v!r},\n" for k, v in info.items()) + "}\n"
        bases = {Path(self.get_ext_fullpath("fusedops._C")).parent}
        if self.into_source:
            bases.add(ROOT / "src" / "fusedops")
        for base in bases:
            if base.is_dir():
                (base / "_build_info.py").write_text(text)


def _cmake_cxx_compiler(build_dir):
    """The C++ compiler CMake configured build_dir with (CXX, or CMake's own pick), from its cache."""
    try:
        text = (Path(build_dir) / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return ""
    m = re.search(r"^CMAKE_CXX_COMPILER:[A-Z]+=(.*)$", text, re.MULTILINE)
    return m.group(1).strip() if m else ""


def _first_version_line(compiler):
    """`compiler --version`'s first line ("g++ (Debian 12.2.0-14) 12.2.0"), or "" if it has none."""
    if not compiler:
        return ""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = out.splitlines()
    return lines[0].strip() if lines else ""


def _tool(name):
    """A build tool installed beside this Python (pip's cmake and ninja), else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


# setuptools (pip's build backend too) runs this file as __main__; the guard lets tests import the
# helpers above without starting a build.
if __name__ == "__main__":
    setup(
        ext_modules=[
            Extension("fusedops._C", sources=[], py_limited_api=True),
            Extension("fusedops._C_cuda", sources=[], py_limited_api=True),
        ],
        cmdclass={"build_ext": CMakeBuild},
        options={"bdist_wheel": {"py_limited_api": PY_LIMITED_API}},
    )
