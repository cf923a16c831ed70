#!/usr/bin/env bash
# Audit the pinned dependency set for known vulnerabilities, with pip-audit.
#
#   bash scripts/audit_deps.sh [CONSTRAINTS]        default: constraints/cpu.txt
#
# Every pin of the file is audited as it is (--no-deps: the file is the complete set, see
# tests/deploy/test_pins.py), local versions dropped (torch==X+cpu is audited as torch==X, the
# same release). The vulnerability database: PyPI's (per-release JSON), else OSV's, else, as a
# partial audit that says so, PyPI's project JSON (the latest release's vulnerabilities: it
# covers the pins that are their project's latest release).
#
# Exit status: 1 when a pinned version has a known vulnerability (the table says which and
# the fixed versions); 0 when none has; 0 as well, printing "dependency audit skipped:
# <reason>", when no database could answer (no network, a mirror without PyPI's JSON API) or
# pip-audit cannot be installed: a missing network never fails CI. Packages the database does
# not know are listed, and do not fail.
#
# pip-audit is no dependency of rollstream's (nor of its tests): on first use it is installed
# into its own venv, build/audit-venv (gitignored; ROLLSTREAM_AUDIT_VENV to move it), so its
# own dependencies never change the project's venv. PIP_AUDIT=/path/to/pip-audit uses an
# existing one. ROLLSTREAM_AUDIT_TIMEOUT: seconds per request to the database (default 20);
# ROLLSTREAM_AUDIT_PYPI_JSON: base URL of the project JSON (default https://pypi.org/pypi).
set -uo pipefail
cd "$(dirname "$0")/.."

CONSTRAINTS="${1:-constraints/cpu.txt}"
VENV="${ROLLSTREAM_AUDIT_VENV:-build/audit-venv}"
TIMEOUT="${ROLLSTREAM_AUDIT_TIMEOUT:-20}"
PYPI_JSON="${ROLLSTREAM_AUDIT_PYPI_JSON:-https://pypi.org/pypi}"

skip() {
  echo "dependency audit skipped: $*"
  exit 0
}

[ -f "$CONSTRAINTS" ] || { echo "audit_deps: no such file: $CONSTRAINTS" >&2; exit 2; }

PIP_AUDIT="${PIP_AUDIT:-}"
if [ -z "$PIP_AUDIT" ]; then
  PIP_AUDIT="$VENV/bin/pip-audit"
  if [ ! -x "$PIP_AUDIT" ]; then
    echo "audit_deps: installing pip-audit into $VENV (once)" >&2
    log="$(mktemp)"
    if ! { python3 -m venv "$VENV" && timeout 600 "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check pip-audit; } >"$log" 2>&1; then
      reason="$(grep -v '^WARNING' "$log" | tail -n 1)"
      rm -f "$log"
      rm -rf "$VENV"
      skip "cannot install pip-audit (${reason:-pip failed})"
    fi
    rm -f "$log"
  fi
fi
PY="$(dirname "$PIP_AUDIT")/python"
[ -x "$PY" ] || PY=python3

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Pins only, local versions dropped (the database knows public releases).
sed -E -e 's/[[:space:]]*#.*$//' -e 's/^([A-Za-z0-9._-]+(\[[^]]*\])?==[^+;[:space:]]+)\+[A-Za-z0-9.]+/\1/' "$CONSTRAINTS" | grep -v '^[[:space:]]*$' >"$work/requirements.txt"
count="$(wc -l <"$work/requirements.txt" | tr -d ' ')"

reasons=()
for service in pypi osv; do
  out="$work/$service.json"
  "$PIP_AUDIT" --requirement "$work/requirements.txt" --no-deps --disable-pip --progress-spinner off \
    --vulnerability-service "$service" --timeout "$TIMEOUT" --format json --output "$out" >"$work/$service.out" 2>"$work/$service.err"
  status=$?
  # What came back: audited packages, the ones the database did not answer for, the vulnerabilities.
  verdict="$("$PY" - "$out" "$service" "$count" <<'EOF'
import json, sys
path, service, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    deps = json.load(open(path))["dependencies"]
except (OSError, ValueError, KeyError):
    print("NONE")
    sys.exit()
audited = [d for d in deps if "skip_reason" not in d]
skipped = [d for d in deps if "skip_reason" in d]
if not audited:
    first = skipped[0]["skip_reason"] if skipped else "no result"
    if service == "pypi" and first.startswith("Dependency not found on PyPI"):
        first += "; PyPI's per-release JSON API (/pypi/NAME/VERSION/json) did not answer: no network, or an index or proxy without it"
    print(f"NONE {service}: none of the {len(deps) or count} pins could be audited ({first})")
    sys.exit()
vulns = [(d, v) for d in audited for v in d.get("vulns", [])]
print(f"AUDITED {len(audited)} of {len(deps)} pinned packages against the {service} database: "
      f"{len(vulns)} known vulnerabilit{'y' if len(vulns) == 1 else 'ies'}")
for d, v in vulns:
    fixes = ", ".join(v.get("fix_versions") or []) or "no fixed version"
    aliases = ", ".join(v.get("aliases") or [])
    print(f"  {d['name']}=={d['version']}: {v['id']}{' (' + aliases + ')' if aliases else ''}; fixed in: {fixes}")
for d in skipped:
    print(f"  not audited: {d['name']}: {d['skip_reason']}")
print("VULNERABLE" if vulns else "CLEAN")
EOF
)"
  case "$verdict" in
    NONE*)
      reason="${verdict#NONE}"
      reason="${reason# }"
      if [ -z "$reason" ]; then
        reason="$service: pip-audit exited $status ($(grep -v '^WARNING' "$work/$service.err" | tail -n 1))"
      fi
      reasons+=("$reason")
      ;;
    *)
      echo "${verdict#AUDITED }" | sed '$d'
      [ "$(echo "$verdict" | tail -n 1)" = VULNERABLE ] && exit 1
      exit 0
      ;;
  esac
done
# Last resort, partial: PyPI's project JSON (/pypi/NAME/json) lists the vulnerabilities of the
# project's latest release only, so it audits exactly the pins that are the latest release;
# the others are listed as not audited (where only that endpoint answers, as behind some proxies).
verdict="$("$PY" - "$work/requirements.txt" "$TIMEOUT" "$PYPI_JSON" <<'EOF'
import concurrent.futures, json, re, sys, urllib.request
pins = [m.groups() for line in open(sys.argv[1]) if (m := re.match(r"([A-Za-z0-9._-]+)(?:\[[^]]*\])?==([^;\s]+)", line.strip()))]
def latest(pin):
    name, version = pin
    try:
        with urllib.request.urlopen(f"{sys.argv[3]}/{name}/json", timeout=float(sys.argv[2])) as r:
            data = json.load(r)
        return name, version, data["info"]["version"], data.get("vulnerabilities"), ""
    except Exception as e:  # no network, not on PyPI: that pin is not audited
        return name, version, None, None, f"{e.__class__.__name__}: {e}"
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    rows = list(pool.map(latest, pins))
audited = [r for r in rows if r[2] is not None and r[2] == r[1] and r[3] is not None]
if not audited:
    errors = sorted({r[4] for r in rows if r[4]})
    print("NONE pypi project JSON: " + (errors[0] if errors else "no pin is its project's latest release"))
    sys.exit()
vulns = [(r, v) for r in audited for v in r[3]]
print(f"AUDITED {len(audited)} of {len(rows)} pinned packages (PyPI project JSON: the pins that are their project's latest release): "
      f"{len(vulns)} known vulnerabilit{'y' if len(vulns) == 1 else 'ies'}")
for r, v in vulns:
    fixes = ", ".join(v.get("fixed_in") or []) or "no fixed version"
    aliases = ", ".join(v.get("aliases") or [])
    print(f"  {r[0]}=={r[1]}: {v.get('id')}{' (' + aliases + ')' if aliases else ''}; fixed in: {fixes}")
for r in rows:
    if r not in audited:
        why = r[4] or f"pinned {r[1]}, latest {r[2]}: only the latest release's vulnerabilities are published there"
        print(f"  not audited: {r[0]}: {why}")
print("VULNERABLE" if vulns else "CLEAN")
EOF
)"
case "$verdict" in
  AUDITED*)
    joined="$(printf '%s; ' "${reasons[@]}")"
    echo "dependency audit partial: the pip-audit databases did not answer (${joined%; })"
    echo "${verdict#AUDITED }" | sed '$d'
    [ "$(echo "$verdict" | tail -n 1)" = VULNERABLE ] && exit 1
    exit 0
    ;;
  *)
    reasons+=("${verdict#NONE }")
    ;;
esac
joined="$(printf '%s; ' "${reasons[@]}")"
skip "no vulnerability database answered for $CONSTRAINTS: ${joined%; }"
