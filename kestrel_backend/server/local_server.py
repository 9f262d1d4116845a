"""Start a real tritonserver from the nvidia-pytriton wheel (no Docker) on our model repository.

    python -m kestrel_backend.server.local_server [--http-port 8000 --grpc-port 8001 --metrics-port 8002]

The wheel ships the server, the Python backend and backend stubs per Python version; this builds
a backend folder with the stub of the running Python and starts the server with the library path the
stub needs to find libpython. The stub's interpreter ignores PYTHONPATH and takes its packages from the
environment of the `python3` first on PATH, so the running Python's folder goes first on PATH.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
REPOSITORY = PROJECT / "model_repository"


def pytriton_root() -> Path:
    """The wheel's server folder, found without importing pytriton (its client needs more packages)."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("nvidia-pytriton is not installed: pip install --no-deps nvidia-pytriton==0.7.0")
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def backend_dir(root: Path) -> Path:
    """root/python/: libtriton_python.so, triton_python_backend_utils.py, and this Python's stub."""
    src = pytriton_root()
    python = root / "python"
    python.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    files = {
        "libtriton_python.so": src / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": src / "backends" / "python" / "triton_python_backend_utils.py",
        "triton_python_backend_stub": src / "python_backend_stubs" / version / "triton_python_backend_stub",
    }
    for name, target in files.items():
        if not target.exists():
            raise SystemExit(f"{target} is missing: is nvidia-pytriton installed for Python {version}?")
        link = python / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return root


def server_command(http: int, grpc: int, metrics: int, repository: Path = REPOSITORY,
                   work: Path = PROJECT / ".runtime", log_verbose: int = 0) -> tuple[list[str], dict]:
    src = pytriton_root()
    libs = [str(src.parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join([p for p in libs if p] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["PATH"] = ":".join([str(Path(sys.executable).parent), env.get("PATH", "")]).rstrip(":")
    cmd = [str(src / "bin" / "tritonserver"), f"--model-repository={repository}",
           f"--backend-directory={backend_dir(work / 'backends')}", f"--http-port={http}", f"--grpc-port={grpc}",
           f"--metrics-port={metrics}", "--allow-metrics=true", f"--log-verbose={log_verbose}",
           # servers of one machine share /dev/shm: each its own Python-backend regions
           f"--backend-config=python,shm-region-prefix-name=kestrel_{grpc}_"]
    return cmd, env


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m kestrel_backend.server.local_server")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-repository", type=Path, default=REPOSITORY)
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver's verbose log level")
    args = p.parse_args()
    cmd, env = server_command(args.http_port, args.grpc_port, args.metrics_port, args.model_repository,
                              log_verbose=args.log_verbose)
    os.execve(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
