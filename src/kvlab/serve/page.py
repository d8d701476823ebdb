"""The playground served at `GET /`: one self-contained page (no external assets), streaming from
`/v1/chat/completions` and showing live tokens/s, time to first token, acceptance length and cached
prompt tokens."""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvlab serve</title>
<link rel="icon" href="data:,">
<style>
  body { font: 15px/1.45 system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }
  main { max-width: 860px; margin: 0 auto; padding: 24px; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  .sub { color: #5b6475; margin-bottom: 16px; }
  textarea { width: 100%; box-sizing: border-box; min-height: 110px; font: inherit; padding: 10px;
             border: 1px solid #c9ced8; border-radius: 6px; }
  .row { display: flex; flex-wrap: wrap; gap: 12px; align-items: end; margin: 12px 0; }
  label { display: flex; flex-direction: column; font-size: 12px; color: #5b6475; gap: 3px; }
  input, select, button { font: inherit; padding: 6px 8px; border: 1px solid #c9ced8; border-radius: 6px; }
  input[type=number] { width: 90px; }
  button { background: #2456d6; color: white; border-color: #2456d6; cursor: pointer; padding: 7px 18px; }
  button:disabled { opacity: .5; cursor: default; }
  #output { white-space: pre-wrap; background: white; border: 1px solid #c9ced8; border-radius: 6px;
            padding: 12px; min-height: 120px; }
  .stats { display: grid; grid-template-columns: repeat(5, 1fr); gap: 8px; margin-top: 12px; }
  .stat { background: white; border: 1px solid #dde1e8; border-radius: 6px; padding: 8px; }
  .stat b { display: block; font-size: 18px; }
  .stat span { font-size: 12px; color: #5b6475; }
  #status { margin-top: 8px; color: #5b6475; min-height: 1.4em; }
  #status.error { color: #b42318; }
  .note { background: #fff7e0; border: 1px solid #e8c770; border-radius: 6px; padding: 8px 10px; font-size: 13px;
          margin: 0 0 12px; }
  .drafting-only, .lossless-only, .lossy-only { display: none; }
  body[data-mode=lossy] .drafting-only, body[data-mode=lossless] .drafting-only,
  body[data-mode=lossless] .lossless-only { display: flex; }
  body[data-mode=lossy] #mode-note.lossy-only, #output-box[data-mode=lossy] #output-note { display: block; }
</style>
</head>
<body>
<main>
  <h1>kvlab serve</h1>
  <div class="sub">Model <code>{{MODEL}}</code>. Lossless mode drafts from a compressed cache and verifies
    with the full one: greedy output is the plain output, token for token (in float32).</div>
  <textarea id="prompt" placeholder="Ask something...">What is the capital of France?</textarea>
  <div class="row">
    <label>Mode <select id="mode">
      <option value="plain">plain (full cache)</option>
      <option value="lossy">lossy (compressed cache)</option>
      <option value="lossless">lossless (draft + verify)</option>
    </select></label>
    <label class="drafting-only">Drafter <input id="drafter" value="snapkv" size="10"></label>
    <label class="lossless-only">Draft length <input id="draft-length" value="auto" size="5"></label>
    <label>Max tokens <input id="max-tokens" type="number" min="1" value="128"></label>
    <label>Temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0"></label>
    <label>API key <input id="api-key" type="password" size="12" placeholder="(if required)"></label>
    <button id="send">Send</button>
  </div>
  <div id="mode-note" class="note lossy-only">Lossy mode decodes from the drafter's compressed KV cache: the
    compressor drops or quantizes KV entries, so the output is expected to differ from full-KV (plain) output
    and can degrade at small budgets. Lossless mode drafts from the same compressed cache and verifies with the
    full cache, so its output is the plain output (token for token at temperature 0, in float32).</div>
  <div id="output-box">
    <div id="output-note" class="note lossy-only">Lossy output: read from a compressed KV cache, expected to
      differ from plain output. Lossless mode gives the plain output.</div>
    <div id="output" aria-live="polite"></div>
  </div>
  <div class="stats">
    <div class="stat"><b id="stat-tps">&ndash;</b><span>tokens/s</span></div>
    <div class="stat"><b id="stat-ttft">&ndash;</b><span>time to first token</span></div>
    <div class="stat"><b id="stat-tokens">&ndash;</b><span>tokens</span></div>
    <div class="stat"><b id="stat-acceptance">&ndash;</b><span>acceptance length</span></div>
    <div class="stat"><b id="stat-cached">&ndash;</b><span>cached prompt tokens</span></div>
  </div>
  <div id="status"></div>
</main>
<script>
const $ = (id) => document.getElementById(id);
const modeSelect = $("mode");
modeSelect.value = "{{MODE}}";
// The output note follows the mode of the text shown; before the first answer, the mode selected.
let outputMode = null;
function syncMode() {
  document.body.dataset.mode = modeSelect.value;
  $("output-box").dataset.mode = outputMode || modeSelect.value;
}
modeSelect.addEventListener("change", syncMode);
syncMode();

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function send() {
  const button = $("send");
  button.disabled = true;
  $("output").textContent = "";
  for (const id of ["stat-tps", "stat-ttft", "stat-tokens", "stat-acceptance", "stat-cached"]) {
    $(id).textContent = "\\u2013";
  }
  setStatus("waiting for the first token...");
  const kvlab = { mode: modeSelect.value };
  outputMode = kvlab.mode;
  syncMode();
  if (kvlab.mode !== "plain") {
    kvlab.drafter = $("drafter").value.trim() || "snapkv";
    const length = $("draft-length").value.trim();
    if (kvlab.mode === "lossless" && length && length !== "auto") kvlab.draft_length = Number(length);
  }
  const body = {
    messages: [{ role: "user", content: $("prompt").value }],
    max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    stream: true,
    stream_options: { include_usage: true },
    kvlab,
  };
  const headers = { "Content-Type": "application/json" };
  if ($("api-key").value) headers["Authorization"] = "Bearer " + $("api-key").value;
  const started = performance.now();
  let firstAt = null, tokens = 0;
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body) });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || response.statusText);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices && chunk.choices[0];
        if (choice && choice.delta && choice.delta.content) {
          if (firstAt === null) {
            firstAt = performance.now();
            $("stat-ttft").textContent = ((firstAt - started) / 1000).toFixed(2) + " s";
            setStatus("streaming...");
          }
          $("output").textContent += choice.delta.content;
          tokens = chunk.kvlab ? chunk.kvlab.completion_tokens : tokens + 1;
          $("stat-tokens").textContent = tokens;
          const seconds = (performance.now() - firstAt) / 1000;
          if (seconds > 0 && tokens > 1) $("stat-tps").textContent = ((tokens - 1) / seconds).toFixed(1);
        }
        if (chunk.kvlab && chunk.kvlab.mode) showStats(chunk.kvlab);
        if (chunk.usage) {
          $("stat-tokens").textContent = chunk.usage.completion_tokens;
          $("stat-cached").textContent = chunk.usage.prompt_tokens_details.cached_tokens;
        }
      }
    }
    setStatus("done");
  } catch (error) {
    setStatus(String(error.message || error), true);
  } finally {
    button.disabled = false;
  }
}

function showStats(stats) {
  if (stats.decode_s > 0 && stats.completion_tokens > 1) {
    $("stat-tps").textContent = ((stats.completion_tokens - 1) / stats.decode_s).toFixed(1);
  }
  $("stat-ttft").textContent = stats.ttft_s.toFixed(2) + " s";
  $("stat-tokens").textContent = stats.completion_tokens;
  $("stat-acceptance").textContent = stats.mode === "lossless" ? stats.acceptance_length.toFixed(2) : "n/a";
  $("stat-cached").textContent = stats.cached_tokens;
}

$("send").addEventListener("click", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) send();
});
</script>
</body>
</html>
"""
