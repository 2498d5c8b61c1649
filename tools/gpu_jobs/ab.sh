#!/usr/bin/env bash
# A/B of two trees in alternating processes: the same command run from each tree in turn, ROUNDS
# times, every line it prints prefixed with the tree's name and the round.
#
#   git archive <rev> | tar -x -C .scratch/base     # here: the other tree, carried to the GPU machine
#   ROUNDS=2 bash tools/gpu_jobs/ab.sh . .scratch/base -- python3 -m tools.mask_mod_compile_time --device cuda
#
# Each side runs from its own directory with PYTHONPATH set to it: `python -m` puts the working
# directory first on sys.path, so a command started from the repository root imports the root's
# flexmask whatever PYTHONPATH says (docs/performance.md, section 12, an A/B that measured one tree
# twice). Each side first prints the flexmask it imports, so that a log shows which code ran.
# B_EXTRA: arguments added to side B's command, for the A/B of a switch within one tree:
#
#   B_EXTRA=--block-mask bash tools/gpu_jobs/ab.sh . . -- python3 -m tools.mask_mod_compile_time --device cuda
set -uo pipefail
. tools/gpu_jobs/setup.sh
if [ $# -lt 4 ] || [ "$3" != "--" ]; then
    echo "usage: ROUNDS=n bash tools/gpu_jobs/ab.sh TREE_A TREE_B -- COMMAND..." >&2
    exit 2
fi
A=$(cd "$1" && pwd)
B=$(cd "$2" && pwd)
shift 3
for round in $(seq 1 "${ROUNDS:-2}"); do
    for name in A B; do
        tree=$([ "$name" = A ] && echo "$A" || echo "$B")
        (
            cd "$tree" || exit 1
            export PYTHONPATH=$tree
            "$PYTHON" -c "import flexmask, os; print('imports', os.path.dirname(flexmask.__file__))"
            if [ "$name" = B ]; then "$@" ${B_EXTRA:-}; else "$@"; fi
        ) 2>&1 | grep -v -i warn | sed "s|^|$name r$round: |"
    done
done
