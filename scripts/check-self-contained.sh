#!/usr/bin/env bash
# Fails when a tracked file reaches outside the repository: everything the code, tests, benches,
# scripts and docs need must be in a bare `git clone`. Run by .ci/run before the tests.
#
# Checked in every tracked text file (recorded fixture data and Cargo.lock excluded):
#  1. paths that name another machine's or folder's layout: a sibling `shared` folder next to the
#     clone and its contents, the workplace's `/work/`, home directories (`/root/`, `/home/<user>/`, `/Users/<user>/`);
#     and references to design notes that lived there (`DESIGN §N`, `DESIGN.md`, `protocols §N`)
#     instead of docs/architecture.md and docs/protocols.md;
#  2. relative paths that climb out of the repository: in a crate, `CARGO_MANIFEST_DIR`-relative
#     paths are at most `../../` deep (the repository root); `include_str!`/`#[path]` and Markdown
#     links are relative to their own file; anywhere else a `../` is relative to the repository
#     root, where scripts and documented commands run, and so always leaves it;
#  3. links to a docs anchor (`docs/<name>.md#<anchor>`, or `<name>.md#<anchor>` inside docs/) name a
#     heading that exists (GitHub's heading ids: lower case, punctuation dropped, spaces -> '-').
# Scratch output locations (`--out /tmp/...`) and per-user caches (`~/.cache/kvmesh`) are not
# references to content and are allowed.
set -euo pipefail
cd "$(dirname "$0")/.."

SELF=scripts/check-self-contained.sh
# Files another change is rewriting at the same time: their matches are listed as PENDING instead
# of failing the check. Remove an entry as soon as that file is clean (a clean entry is reported).
PENDING=(
)

is_pending() {
  local f
  for f in "${PENDING[@]+"${PENDING[@]}"}"; do [ "$f" = "$1" ] && return 0; done
  return 1
}

mapfile -t FILES < <(git ls-files \
  | grep -v -E '^tests/fixtures/.*\.(json|jsonl|txt)$' \
  | grep -v -x -e 'Cargo.lock' -e "$SELF")
# Text files only (git's own binary detection), as they are in the work tree.
mapfile -t FILES < <(git grep -I -l -e '' -- "${FILES[@]}")

failures=0
pending=0
flag() { # "file:line:text" "what" [label]
  local file=${1%%:*}
  if is_pending "$file"; then
    echo "PENDING  $1 -- $2"
    pending=$((pending + 1))
  else
    echo "${3:-OUTSIDE}  $1 -- $2"
    failures=$((failures + 1))
  fi
}

# 1. Names of places outside the repository.
PATTERNS=(
  '\.\./shared([/[:space:]`"'"'"')]|$)|(^|[^[:alnum:]_.-])shared/(vllm-fixtures|traces|DESIGN|protocols|STYLE|seeds)'
  '(^|[^[:alnum:]_.~-])/work/'
  '(^|[^[:alnum:]_.~-])/(root|home/[^/[:space:]]+|Users/[^/[:space:]]+)/'
  'DESIGN( §|\.md)|(^|[^.[:alnum:]])protocols §'
)
WHAT=(
  'a sibling shared folder is not part of a clone: copy what is needed into the repository'
  'a workplace path: use a path inside the repository'
  'a home directory: use a path inside the repository'
  'design notes outside the repository: link docs/architecture.md or docs/protocols.md'
)
for i in "${!PATTERNS[@]}"; do
  while IFS= read -r hit; do
    [ -n "$hit" ] && flag "$hit" "${WHAT[$i]}"
  done < <(git grep -n -I -E -e "${PATTERNS[$i]}" -- "${FILES[@]}" || true)
done

# 2. Relative paths that climb out of the repository.
while IFS= read -r hit; do
  [ -n "$hit" ] && flag "$hit" 'this ../ path leaves the repository'
done < <(awk '
  FNR == 1 { n = split(FILENAME, parts, "/"); depth = n - 1; crate = (parts[1] == "crates") }
  {
    line = $0
    while (match(line, /(\.\.\/)+/)) {
      ups = RLENGTH / 3
      before = substr(line, 1, RSTART - 1)
      if (FILENAME ~ /\.md$/ && before ~ /\]\($/) {
        bad = ups > depth                          # Markdown link: relative to the file
      } else if (FILENAME ~ /(^|\/)(pyproject|Cargo)\.toml$/) {
        bad = ups > depth                          # package manifests: relative to their own directory
      } else if (crate && $0 ~ /include_str!|include_bytes!|#\[path/) {
        bad = ups > depth                          # relative to the source file
      } else if (crate) {
        bad = ups > 2                              # relative to CARGO_MANIFEST_DIR (crates/<name>)
      } else {
        bad = 1                                    # relative to the repository root
      }
      if (bad) { printf "%s:%d:%s\n", FILENAME, FNR, $0; break }
      line = substr(line, RSTART + RLENGTH)
    }
  }' "${FILES[@]}")

# 3. Anchors into docs/*.md (and within any Markdown file) exist.
slugs() { # heading ids of a Markdown file, one per line (fenced code skipped)
  awk '
    /^```/ { fence = !fence; next }
    !fence && /^#+ / {
      h = $0; sub(/^#+ +/, "", h); h = tolower(h)
      gsub(/[^a-z0-9 _-]/, "", h); gsub(/ /, "-", h)
      if (seen[h]++) print h "-" (seen[h] - 1); else print h
    }' "$1"
}
while IFS= read -r hit; do
  [ -n "$hit" ] || continue
  file=${hit%%:*}
  rest=${hit#*:}
  rest=${rest#*:}
  ref=$(grep -o -E '([A-Za-z0-9_./-]*/)?[A-Za-z0-9_-]+\.md#[A-Za-z0-9_-]+' <<<"$rest" || true)
  for r in $ref; do
    target=${r%%#*}
    anchor=${r#*#}
    case "$target" in
      docs/*) ;;                                  # from the repository root
      */*) continue ;;                            # other relative links are not checked here
      *) [[ "$file" == docs/* ]] || continue; target="docs/$target" ;;
    esac
    if [ ! -f "$target" ]; then
      flag "$hit" "links $target, which does not exist" BROKEN
    elif ! slugs "$target" | grep -q -x -F -- "$anchor"; then
      flag "$hit" "$target has no heading with id #$anchor" BROKEN
    fi
  done
done < <(git grep -n -I -E -e '[A-Za-z0-9_-]+\.md#[A-Za-z0-9_-]+' -- "${FILES[@]}" || true)
mapfile -t MARKDOWN < <(printf '%s\n' "${FILES[@]}" | grep -E '\.md$')
while IFS= read -r hit; do
  [ -n "$hit" ] || continue
  file=${hit%%:*}
  for anchor in $(grep -o -E '\]\(#[A-Za-z0-9_-]+\)' <<<"${hit#*:}" | sed -E 's/^\]\(#//; s/\)$//'); do
    slugs "$file" | grep -q -x -F -- "$anchor" || flag "$hit" "no heading with id #$anchor in this file" BROKEN
  done
done < <(if [ "${#MARKDOWN[@]}" -gt 0 ]; then git grep -n -I -E -e '\]\(#[A-Za-z0-9_-]+\)' -- "${MARKDOWN[@]}" || true; fi)

for f in "${PENDING[@]+"${PENDING[@]}"}"; do
  if ! grep -q -F "$f" <<<"$(git grep -l -I -E -e "${PATTERNS[0]}|${PATTERNS[3]}" -- "$f" || true)"; then
    echo "check-self-contained: $f is clean now: remove it from PENDING in $SELF"
  fi
done
if [ "$failures" -gt 0 ]; then
  echo "check-self-contained: $failures reference(s) outside the repository or to a missing anchor (${#FILES[@]} files checked)" >&2
  exit 1
fi
note=""
[ "$pending" -gt 0 ] && note=", $pending PENDING in files another change is rewriting"
echo "check-self-contained: ok (${#FILES[@]} files checked$note)"
