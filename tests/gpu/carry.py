#!/usr/bin/env python3
"""Wheels for the lent GPU machine (Python 3.12, torch 2.11, no network), in sets of under 64 MiB:
what a device call can carry. Run here (a machine that reaches PyPI):

    python3 tests/gpu/carry.py .whl/gpu          # -> .whl/gpu/{sglang-a,sglang-b,tools,ray,trl,megatron}
    python3 tests/gpu/carry.py .whl/gpu trl      # only the named sets

On the GPU machine, after each set arrives: `sh tests/gpu/install.sh .whl/gpu/<set>`.

- sglang-a, sglang-b: a REAL SGLang, 0.5.17 (the last release pinning torch==2.11.0, the GPU
  image's), with torch_memory_saver (release/resume of its memory). Its kernel wheel keeps only
  the Hopper (sm90) ops: FA3 (342 MB) is dropped, so the server runs with the triton attention
  backend. SGLang's own pins (transformers 5.12.1 among them) go to a folder of their own, which
  only the SGLang server's interpreter sees (`rollout.engine.python`).
- tools: what the project's processes and tests need that the image lacks (pydantic, pytest,
  Ray's jsonschema, the embedded engine's fastapi and uvicorn);
  small enough to travel with sglang-b.
- ray: Ray 2.60.0 without its Java jar (30 MB; nothing here starts Java workers), for the
  driver (bench/driver_gpu.py); tests/gpu stub Ray where it is absent.
- trl: TRL 1.16.0 and what it and `datasets` import beyond the image's torch, numpy,
  transformers and huggingface_hub, at the CPU venv's versions (accelerate, datasets, pyarrow,
  pandas and python-dateutil, dill, multiprocess, xxhash), for bench/grpo_vs_trl.py and
  bench/time_to_accuracy.py. pyarrow's wheel (50 MB) leaves out Arrow Flight (RPC, 10 MB), its C++
  headers and tests: datasets never loads them.
- megatron: megatron-core 0.19.2 (2.4 MB), for bench/megatron_mfu.py and tests/gpu/test_megatron_gpu.py, and
  torchao 0.18.0 (3.4 MB; float8 training, `training.fp8`).
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")
SGLANG_A = ("sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11 "
            "pydantic-core==2.50.5 soundfile==0.13.1 openai==2.6.1")
SGLANG_B = (
    "xgrammar==0.2.1 transformers==5.12.1 tokenizers==0.22.2 pydantic==2.14.4 annotated-types==0.8.0 anyio==4.16.0 "
    "asttokens==3.0.2 cffi==2.1.1 compressed-tensors==0.20.1 dill==0.4.1 distro==1.9.0 executing==2.3.0 "
    "fastapi==0.165.0 gguf==0.19.0 ipython==9.19.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 jiter==0.19.0 "
    "jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 matplotlib-inline==0.2.2 msgspec==0.23.0 "
    "opentelemetry-api==1.45.3 orjson==3.13.0 parso==0.8.7 partial-json-parser==0.2.1.1.post7 pexpect==4.9.0 "
    "prompt-toolkit==3.0.53 ptyprocess==0.7.0 pure-eval==0.2.4 pybase64==1.5.1 pycparser==3.12 "
    "python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 "
    "sniffio==1.3.1 stack-data==0.6.3 starlette==1.10.0 traitlets==5.16.1 typing-extensions==4.16.0 "
    "typing-inspection==0.4.5 uvicorn==0.55.0 wcwidth==0.9.5 torch-memory-saver==0.0.10")
TOOLS = ("pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pytest==9.2.0 "
         "pluggy==1.6.0 iniconfig==2.3.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 "
         "rpds-py==2026.9.1 "  # Ray's runtime imports jsonschema
         # the embedded engine's HTTP server (fastapi on uvicorn)
         "fastapi==0.150.0 starlette==1.10.0 uvicorn==0.55.0 anyio==4.16.0 h11==0.16.0 annotated-doc==0.0.7 "
         "opentelemetry-api==1.45.2 sniffio==1.3.1")
RAY = "ray==2.60.0 msgpack==1.2.4"
TRL = ("trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 pyarrow==25.0.1 pandas==3.1.1 python-dateutil==2.9.0.post0 "
       "six==1.17.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0")
# the trainer side: its dependencies (torch, numpy, packaging) are on the image; torchao for training.fp8
MEGATRON = "megatron-core==0.19.2 torchao==0.18.0"
SETS = {"sglang-a": SGLANG_A, "sglang-b": SGLANG_B, "tools": TOOLS, "ray": RAY, "trl": TRL, "megatron": MEGATRON}
# wheel name prefix -> member patterns left out
SLIM = {"sglang_kernel-": ("flash_ops", "/sm100/", "infllm_ops", "flashmla_ops"),
        "xgrammar-": (r"lib/libxgrammar\.a$", "/include/"),
        "ray-": ("^ray/jars/",),
        "pyarrow-": (r"^pyarrow/(libarrow_flight|libarrow_python_flight|_flight\.)", "^pyarrow/include/",
                     "^pyarrow/tests/", "^pyarrow/_pyarrow_cpp_tests")}


def download(specs: str, dest: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
                    *specs.split()], check=True)


def slim(src: Path, dest: Path, patterns: tuple[str, ...]) -> None:
    """The wheel without the members matching `patterns`, its RECORD rebuilt (pip checks it).
    Members keep their zip headers: Ray's executables (gcs_server, raylet) need their mode bits."""
    regexes = [re.compile(p) for p in patterns]
    with zipfile.ZipFile(src) as z:
        members = {i.filename: (i, z.read(i)) for i in z.infolist() if not any(r.search(i.filename) for r in regexes)}
    record = next(n for n in members if n.endswith(".dist-info/RECORD"))
    lines = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
             for name, (_, data) in sorted(members.items()) if name != record]
    members[record] = (members[record][0], ("\n".join([*lines, f"{record},,"]) + "\n").encode())
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z:
        for name in sorted(members, key=lambda n: (".dist-info/" in n, n)):
            info, data = members[name]
            z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)


def build_set(specs: str, out: Path) -> None:
    raw = out.parent / f"{out.name}.raw"
    shutil.rmtree(raw, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    download(specs, raw)
    for wheel in sorted(raw.glob("*.whl")):
        patterns = next((p for prefix, p in SLIM.items() if wheel.name.startswith(prefix)), None)
        if patterns:
            slim(wheel, out / wheel.name, patterns)
        else:
            shutil.copy(wheel, out / wheel.name)
    shutil.rmtree(raw)
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    if size >= 62 << 20:  # the tree itself travels too
        raise SystemExit(f"{out}: {size / 2**20:.1f} MiB, over what one device call carries")
    print(f"{out}: {size / 2**20:.1f} MiB")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".whl/gpu")
    names = sys.argv[2:] or list(SETS)
    unknown = sorted(set(names) - set(SETS))
    if unknown:
        raise SystemExit(f"unknown sets {unknown}; known: {list(SETS)}")
    for name in names:
        build_set(SETS[name], out / name)


if __name__ == "__main__":
    main()
