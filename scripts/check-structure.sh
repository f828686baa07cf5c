#!/usr/bin/env bash
# Structure checks CI runs before the tests: no source file of any crate imports a file that
# imports it back (issue 16). scripts/module-cycles.py prints the strongly connected components.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
for src in crates/*/src; do
    if ! out=$(python3 scripts/module-cycles.py "$src"); then
        echo "import circle in $src: $(tail -1 <<<"$out")"
        status=1
    fi
done
if [ "$status" -eq 0 ]; then
    echo "module structure: no import circles in $(ls -d crates/*/src | wc -l) crates"
fi
exit "$status"
