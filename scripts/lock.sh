#!/usr/bin/env bash
# Regenerate the hash-locked dependency sets from pyproject.toml (docs/development.md,
# "Dependencies: the lock files"):
#   requirements/proxy.lock   sandgate[openbao]: what the Sandgate image installs
#   requirements/dev.lock     sandgate[dev]: what scripts/setup.sh installs into .venv
# Every version exact, every file's SHA-256 listed: `pip install --require-hashes -r FILE`
# installs exactly these files or fails. Sandgate itself is not in them (it is installed from
# this checkout, --no-deps). Needs pip-tools in .venv (it is in the dev lock).
#   scripts/lock.sh             keep the locked versions that still satisfy pyproject.toml
#   scripts/lock.sh --upgrade   move every package to its newest allowed version
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url
      --no-emit-find-links --no-emit-trusted-host --resolver=backtracking)
[[ ${1:-} == --upgrade ]] && args+=(--upgrade)
compile=${SANDGATE_PIP_COMPILE:-.venv/bin/pip-compile}  # (not PIP_*: pip reads those as options)
mkdir -p requirements
for set in proxy:openbao dev:dev; do
  name=${set%%:*} extra=${set#*:}
  out=requirements/$name.lock
  "$compile" "${args[@]}" --extra "$extra" --output-file "$out" pyproject.toml
  # The dev extra names sandgate[all] and sandgate[otlp-grpc]: pip-compile then lists this
  # checkout itself (by its local path, without a hash); it is installed from here instead.
  python3 - "$out" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
text = re.sub(r"# WARNING: pip install will require the following package to be hashed\.\n"
              r"# Consider using a hashable URL[^\n]*\n", "", text)
text = re.sub(r"^sandgate @ file://[^\n]*\n(    # via[^\n]*\n)?", "", text, flags=re.M)
text = re.sub(r"^(# +pip-compile[^\n]*)--output-file=\S+", r"\1--output-file=" + path, text,
              flags=re.M)
open(path, "w").write(text)
PY
  echo "== $out: $(grep -c '^[A-Za-z0-9_.-]*==' "$out") packages"
done
