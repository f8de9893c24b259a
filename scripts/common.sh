# Sourced by the shell scripts in this folder, after they set REPO (the repository) and USAGE
# (their one-line usage): the project's interpreter and import path, and their answers to --help
# and to a bad argument.
#
# PYTHON: $PYTHON when set, else REPO/.venv/bin/python when it exists, else python3 on PATH.
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# The calling script's header comment (what it does and how to call it) on stdout; exit 0.
show_help() {
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  echo "Interpreter: $PYTHON (\$PYTHON, else the repository's .venv/bin/python, else python3)."
  exit 0
}

# usage_error MESSAGE: the script's name and MESSAGE, then USAGE, on stderr; exit 2.
usage_error() {
  echo "$(basename "$0"): $1" >&2
  echo "$USAGE" >&2
  exit 2
}

# Answers -h/--help when it is the script's first argument.
case "${1:-}" in -h | --help) show_help ;; esac
