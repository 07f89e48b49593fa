#!/usr/bin/env bash
# Old against new in one device call: the same command run in the trees of several commits.
#   bash scripts/ab-trees.sh prepare REV [REV...]   here: each commit's convpass/, tests/, benchmarks/, models/,
#                                                   scripts/ and pyproject.toml into .ab/REV (git-ignored; carry ".ab")
#   bash scripts/ab-trees.sh run CMD [ARGS...]      on the device machine: CMD run in each .ab/REV in turn,
#                                                   its output in $OUT/ab-REV.txt ({} in ARGS: the repository root)
# Each run's working directory is its own tree and PYTHONPATH starts with it, so both `python3 -m convpass...`
# and `python3 benchmarks/X.py` import that tree's convpass: `python -m` puts the working directory
# first on sys.path (ahead of PYTHONPATH: from the repository root it would import the checkout),
# and a script puts its own folder first, then PYTHONPATH, then the installed checkout.
# Runs alternate (REV1, REV2, REV1, ...) when ROUNDS > 1, so a drift of the clocks falls on both.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  prepare)
    shift; [ "$#" -gt 0 ] || { echo "prepare: name one or more commits" >&2; exit 2; }
    for rev in "$@"; do
      sha=$(git -C "$root" rev-parse --short "$rev^{commit}") || exit 2
      rm -rf "$root/.ab/$sha"; mkdir -p "$root/.ab/$sha"
      git -C "$root" archive "$sha" convpass tests benchmarks models scripts pyproject.toml | tar -x -C "$root/.ab/$sha" || exit 1
      echo ".ab/$sha ($rev)"
    done ;;
  run)
    shift; [ "$#" -gt 0 ] || { echo "run: name the command" >&2; exit 2; }
    out=${OUT:-ab-out}; mkdir -p "$out"
    trees=("$root"/.ab/*/); [ -d "${trees[0]}" ] || { echo "no trees in .ab/: run 'prepare' here and carry .ab" >&2; exit 1; }
    for ((r = 1; r <= ${ROUNDS:-1}; r++)); do
      for t in "${trees[@]}"; do
        sha=$(basename "$t"); args=("${@//\{\}/$root}")
        echo "== $sha round $r: ${args[*]}" >>"$out/ab-$sha.txt"
        (cd "$t" && PYTHONPATH="${t%/}${PYTHONPATH:+:$PYTHONPATH}" "${args[@]}") >>"$out/ab-$sha.txt" 2>&1
        echo "== exit $?" >>"$out/ab-$sha.txt"
      done
    done
    tail -n 3 "$out"/ab-*.txt ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
