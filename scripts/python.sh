# Sourced by scripts/setup.sh: finds the interpreter Sandgate runs on and (re)makes venvs with it.
# Sandgate needs Python 3.12 or newer (mitmproxy 12); 3.13 is preferred (measured faster with
# mitmproxy 12 than 3.12: docs/development.md).

SANDGATE_PYTHONS=(3.13 3.12)  # in order of preference

# The version (major.minor) of interpreter $1 if it is one Sandgate can use, else nothing.
python_ok() {
  "$1" -c 'import sys, ensurepip, venv
v = sys.version_info
if v >= (3, 12) and sys.implementation.name == "cpython": print(f"{v[0]}.{v[1]}")' 2>/dev/null
}

# Print the path of the interpreter to use; on failure say what was looked for and fail.
#   $PYTHON (if set: used as given, or refused), then per preferred version: pythonX.Y on PATH,
#   pyenv's installed versions ($(pyenv root)/versions/X.Y*), then python3 on PATH.
find_python() {
  local v c root looked=()
  if [[ -n ${PYTHON:-} ]]; then
    if [[ -n $(python_ok "$PYTHON") ]]; then command -v "$PYTHON" || echo "$PYTHON"; return 0; fi
    echo "setup: PYTHON=$PYTHON is not a CPython 3.12+ with venv and ensurepip;" \
      "unset PYTHON to let setup look for one" >&2
    return 1
  fi
  root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  for v in "${SANDGATE_PYTHONS[@]}"; do
    looked+=("python$v on PATH")
    if c=$(command -v "python$v") && [[ -n $(python_ok "$c") ]]; then echo "$c"; return 0; fi
    looked+=("$root/versions/$v*/bin/python$v")
    for c in $(compgen -G "$root/versions/$v*/bin/python$v" | sort -rV); do
      if [[ -n $(python_ok "$c") ]]; then echo "$c"; return 0; fi
    done
  done
  looked+=("python3 on PATH")
  if c=$(command -v python3) && [[ -n $(python_ok "$c") ]]; then echo "$c"; return 0; fi
  {
    echo "setup: no suitable Python found. Sandgate needs CPython 3.12 or newer (3.13 preferred)"
    echo "  with the venv and ensurepip modules (Debian: python3-venv). Looked for:"
    printf '    %s\n' "${looked[@]}"
    echo "  Install one (e.g. \`pyenv install 3.13\`, or Debian 13's python3 + python3-venv),"
    echo "  or name it: PYTHON=/path/to/python3.13 scripts/setup.sh"
  } >&2
  return 1
}

# fresh_venv DIR PY: make DIR a venv of PY, unless it already is one of PY's version
# (a venv of another Python is removed first: its compiled packages do not fit the new one).
fresh_venv() {
  local dir=$1 py=$2 want have
  want=$(python_ok "$py")
  if [[ -x $dir/bin/python ]]; then
    have=$("$dir/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' \
      2>/dev/null || true)
    if [[ $have == "$want" && ! -L $dir ]]; then return 0; fi
    echo "setup: $dir was built with Python ${have:-unknown}; making it again with $py ($want)" >&2
    rm -rf "$dir"
  fi
  "$py" -m venv "$dir"
}
