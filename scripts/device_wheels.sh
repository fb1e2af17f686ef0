#!/usr/bin/env bash
# Wheels of the packages the engine needs that an accelerator host's image lacks (x86-64 Linux,
# no network there), downloaded here into .whl/ (git-ignored); the device run carries .whl and
# benchmarks/device_run.sh (GPU) or benchmarks/tpu_run.sh (TPU) installs them. The versions
# are this environment's, so both sides run the same code.
#   bash scripts/device_wheels.sh [PYTHON_VERSION]   the host's Python: 3.12 (GPU image, the
#                                                    default) or 3.11 (TPU image)
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
rm -rf .whl && mkdir -p .whl
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions llguidance flatbuffers; do
  version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "$name is not installed here: pip install -e '.[test]' first" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$name==$version"
done
ls -l .whl
