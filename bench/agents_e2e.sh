#!/usr/bin/env bash
# Claude Code and Codex, the real programs, for one default turn each against `ds4py serve` (the demo model
# unless MODEL is set). Needs node/npm (the clients are installed into a scratch folder, nothing global) and
# writes their outputs to $OUT (default: a fresh temporary folder). A random-weight demo model never emits
# EOS, so each turn ends at the token cap (CLAUDE_CODE_MAX_OUTPUT_TOKENS / serve --max-tokens): both clients
# then report "max output tokens" - the request, the stream and the turn completed. bench/agents_load.py runs
# both through vllm-router and under load, and through the scripted tool loop (tests/test_agents_loop.py).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
PORT=${PORT:-8765}
CAP=${CAP:-48}
mkdir -p "$OUT/home/.codex" "$OUT/work" "$OUT/clients"
(cd "$OUT/clients" && npm install --silent --no-audit --no-fund @anthropic-ai/claude-code @openai/codex >/dev/null)
BIN="$OUT/clients/node_modules/.bin"
cd "$REPO"
OPENBLAS_NUM_THREADS=1 python3 -m ds4py serve --port "$PORT" --max-tokens "$CAP" ${MODEL:+-m "$MODEL"} \
    >"$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
export HOME="$OUT/home"
cat >"$HOME/.codex/config.toml" <<TOML
model = "deepseek-v4-flash"
model_provider = "ds4py"
[model_providers.ds4py]
name = "ds4py"
base_url = "http://127.0.0.1:$PORT/v1"
wire_api = "responses"
env_key = "DS4PY_KEY"
TOML
cd "$OUT/work"
set +e
ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=sk-local CLAUDE_CODE_MAX_OUTPUT_TOKENS="$CAP" \
    DISABLE_TELEMETRY=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
    timeout 900 "$BIN/claude" -p "Say hello." --model deepseek-v4-flash --output-format json >"$OUT/claude.json" 2>"$OUT/claude.err"
echo "claude code: exit $? ($(head -c 300 "$OUT/claude.json"))"
DS4PY_KEY=sk-local timeout 900 "$BIN/codex" exec --skip-git-repo-check "Say hello." >"$OUT/codex.txt" 2>"$OUT/codex.err"
echo "codex: exit $? ($(grep -E 'ERROR|tokens used' -A1 "$OUT/codex.err" | tr '\n' ' ' | head -c 300))"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^ds4py_(requests_total|prompt_tokens_total|cached_prompt_tokens_total|kv_cache_requests_total)' \
    | tee "$OUT/metrics.txt"
echo "outputs in $OUT"
