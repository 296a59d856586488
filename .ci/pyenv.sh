#!/usr/bin/env bash
# Prepare the virtual environment for one extra CPython version: 3.12 from the image's
# pyenv, 3.13 and 3.14 from the prebuilt interpreters in ../shared/python/ (its README.md).
#   .ci/pyenv.sh --check VER   exit 0 if VER can be set up here, else say why and exit 1
#   .ci/pyenv.sh VER VENV      unpack the interpreter, create VENV, install torch and the
#                              test dependencies (once; redone when pyproject.toml changes)
set -euo pipefail
cd "$(dirname "$0")/.."

PYDIST=${PYDIST:-}
if [ -z "$PYDIST" ]; then
    for d in ../shared/python ../../shared/python; do
        if [ -d "$d" ]; then PYDIST=$d; break; fi
    done
fi

check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
ver=${1:?usage: pyenv.sh [--check] VERSION [VENV]}
venv=${2:-.venv-$ver}

case "$ver" in
    # the image's pyenv holds 3.12.1, built --enable-shared with an absolute run path:
    # used where it is, never unpacked or copied
    3.12) tarball=; dest=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.12.1; pydir=. ;;
    3.13) tarball=cpython-3.13.15-bookworm-x86_64.tar.xz; dest=$PWD/.pythons; pydir=py313 ;;
    # relocatable only under /opt: its program interpreter is an absolute /opt path
    3.14) tarball=cpython-3.14.10-sid-portable-x86_64.tar.xz; dest=/opt; pydir=py314 ;;
    *) echo "pyenv.sh: no prebuilt interpreter is known for Python $ver" >&2; exit 1 ;;
esac
python=$dest/$pydir/bin/python$ver

if [ ! -x "$python" ] && [ -z "$tarball" ]; then
    echo "SKIP Python $ver: $python not found (pyenv's $ver is not installed here)" >&2
    exit 1
fi
if [ ! -x "$python" ] && [ ! -f "${PYDIST:-.}/$tarball" ]; then
    echo "SKIP Python $ver: interpreter tarball $tarball not found" \
         "(looked in ${PYDIST:-../shared/python}; set PYDIST=DIR to point at it)" >&2
    exit 1
fi
if [ "$check" = 1 ]; then exit 0; fi

if [ ! -x "$python" ]; then
    echo "unpacking $tarball into $dest"
    mkdir -p "$dest"
    tar -xJf "$PYDIST/$tarball" -C "$dest"
fi

stamp=$venv/.deps
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi

if [ ! -x "$venv/bin/python" ]; then
    if [ "$ver" = 3.14 ]; then
        # Debian's ensurepip looks in /usr/share/python-wheels: bootstrap pip ourselves
        "$python" -m venv --without-pip "$venv"
        whl=$(ls "$dest/$pydir"/share/python-wheels/pip-*.whl | head -n1)
        "$venv/bin/python" "$whl/pip" install -q "$whl"
    else
        "$python" -m venv "$venv"
    fi
fi
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip setuptools wheel
# PyPI's torch for 3.12/3.13/3.14 is the CUDA build; install it without its 2.7 GB of
# dependencies, then the smallest NVIDIA set that lets it import (the README measures it).
"${pip[@]}" --no-deps "torch==2.13.0"
"${pip[@]}" filelock "typing-extensions>=4.10.0" "setuptools>=77.0.3" "sympy>=1.13.3" \
    "networkx>=2.5.1" jinja2 "fsspec>=0.8.5" \
    "cuda-toolkit[cublas,cufft,cufile,curand,cusparse,nvrtc,nvjitlink]==13.0.3" \
    nvidia-cudnn-cu13==9.20.0.48 nvidia-cusparselt-cu13==0.8.1 \
    nvidia-nccl-cu13==2.29.7 nvidia-nvshmem-cu13==3.4.5 \
    pytest numpy matplotlib "transformers>=5,<6"
"$venv/bin/python" -c "import torch; torch.ones(2) + 1"
touch "$stamp"
