#!/usr/bin/env bash
# The ceiling step of .ci/run: CPython 3.13 (.ci/python313.sh) and, in a fresh venv each run, the newest release of
# every runtime and test dependency (no upper pins; torch pinned to 2.13.0, the reference side, which pip resolves to
# its cp313 wheel). It runs `flax-ln parity` and the tests marked `ceiling` (pyproject.toml, markers). A new release
# of jax, flax, equinox or keras can fail it with no change of ours: that is intended, and the versions it ran are
# printed first. Make the same venv by hand: CONTRIBUTING.md ("The three venvs CI proves").
set -euo pipefail
cd "$(dirname "$0")/.."
root="${FLAX_LN_CEILING_DIR:-${TMPDIR:-/tmp}}"
need_gib=12   # the venv is about 6 GiB (torch's cp313 wheel brings its CUDA packages), pip's cache as much again
free_gib=$(df -Pk "$root" | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "$free_gib" -lt "$need_gib" ]; then
  echo "ceiling: needs about $need_gib GiB free in $root for its venv and pip's cache, and $free_gib GiB are free:" \
    "free some, or point FLAX_LN_CEILING_DIR at a larger disk" >&2
  exit 1
fi
python313="$(bash .ci/python313.sh)"
venv="$(mktemp -d "$root/flax-ln-ceiling-XXXXXX")"
trap 'rm -rf "$venv"' EXIT   # a fresh venv each run; pip's cache keeps the next one quick
"$python313" -m venv "$venv/venv"
pip_install() {   # the registry retried once
  "$venv/venv/bin/python" -m pip install --quiet "$@" || "$venv/venv/bin/python" -m pip install --quiet "$@"
}
pip_install --upgrade pip
pip_install torch==2.13.0   # first, as everywhere: nothing else picks a torch
# everything else at its newest (--upgrade-strategy eager: a dependency already satisfied is upgraded too), torch
# named again so that eager upgrading keeps it
pip_install --upgrade --upgrade-strategy eager -e ".[torch,test,equinox,keras]" torch==2.13.0
versions="$("$venv/venv/bin/python" - <<'PY'
import importlib.metadata as m
import sys

names = ("jax", "jaxlib", "flax", "numpy", "torch", "equinox", "keras", "optax", "transformers", "penzai")
print(f"CPython {sys.version.split()[0]} ({sys.executable});", ", ".join(f"{n} {m.version(n)}" for n in names))
PY
)"
echo "ceiling: $versions"
case "$versions" in
  *"torch 2.13.0"*) ;;
  *) echo "ceiling: torch 2.13.0 expected, the resolver installed another" >&2; exit 1 ;;
esac
failed() { echo "ceiling: $1 failed on $versions" >&2; exit 1; }
(cd "$venv" && "$venv/venv/bin/flax-ln" parity --quiet) || failed "flax-ln parity"   # the README's check, on the ceiling
"$venv/venv/bin/python" -m pytest -q -m ceiling || failed "pytest -m ceiling"
