#!/usr/bin/env bash
# Structure checks CI runs before the tests: no source file imports a file that imports it back
# (issues 16, 34), in Rust (every crate's src/ tree: scripts/module-cycles.py) and in Python
# (everything under python/, function-local imports included: scripts/py-import-cycles.py).
# Both print the graph and the strongly connected components.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
for src in crates/*/src; do
    if ! out=$(python3 scripts/module-cycles.py "$src"); then
        echo "import circle in $src: $(tail -1 <<<"$out")"
        status=1
    fi
done
if ! out=$(python3 scripts/py-import-cycles.py python); then
    echo "import circle in python/:"
    grep -E '^  |^cycles:' <<<"$out"
    status=1
fi
if [ "$status" -eq 0 ]; then
    echo "module structure: no import circles in $(ls -d crates/*/src | wc -l) crates and python/"
fi
exit "$status"
