#!/usr/bin/env bash
# Prepare a checkout for a GPU machine that has PyTorch and Triton but no network:
#
#   bash scripts/offline_wheels.sh        (on a machine with a network, from the repository root)
#
# Downloads into the ignored .whl/ the wheels of what k3lab needs that such an image may lack (the
# notebook and plotting stack, latex2mathml, nbval, pytest-xdist, pytest-timeout, hypothesis, tqdm,
# fla-core, HolisticTraceAnalysis), for CPython 3.12 on x86-64, and FlashMLA's library into
# .cache/peers/. Packages a GPU image already holds (torch, triton, numpy, pytest and its plugins' base)
# are left out so they are not shadowed.
# docs/gpu_check.md says how to install them there and run the check.
set -euo pipefail
[ -f pyproject.toml ] && grep -q '^name = "k3lab"' pyproject.toml || { echo "run me from the k3lab checkout's root"; exit 2; }
PYVER=${PYVER:-3.12}
plat="--only-binary=:all: --python-version $PYVER --implementation cp"
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64 any; do
  plat="$plat --platform $p"
done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q $plat -d "$tmp" plotly ipywidgets nbval nbclient nbformat nbconvert ipykernel \
  jupyterlab_widgets widgetsnbextension tqdm latex2mathml pytest-xdist pytest-timeout hypothesis einops
python3 -m pip download -q --no-deps $plat -d "$tmp" fla-core==0.6.0
# HTA (pyproject's hta extra) and the PyYAML it imports without declaring it, about 1.2 MB; the networkx
# and psutil it also imports are the image's (torch brings networkx). pydot is not imported on k3lab's path.
python3 -m pip download -q --no-deps $plat -d "$tmp" HolisticTraceAnalysis==0.5.0 pyyaml
rm -rf .whl && mkdir .whl
keep_image='^(pytest|pluggy|iniconfig|coverage|packaging|jinja2|markupsafe|attrs|psutil|pygments|typing_extensions|narwhals|python_dateutil|tzdata|numpy|torch|triton)-'
for f in "$tmp"/*.whl; do basename "$f" | grep -qiE "$keep_image" || cp "$f" .whl/; done
echo "wheels: $(ls .whl | wc -l) files, $(du -sh .whl | cut -f1) in .whl/"
if python3 -c "import k3lab.ops.mla_decode.peers" 2>/dev/null; then
  python3 -m k3lab.ops.mla_decode.peers fetch || echo "FlashMLA fetch failed: the MLA study runs without its peer"
else
  echo "(FlashMLA's library: run 'python -m k3lab.ops.mla_decode.peers fetch' in your venv to put it in .cache/peers/)"
fi
