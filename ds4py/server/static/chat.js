// The ds4py chat page: talks to this server's own /v1/chat/completions (SSE), keeps conversations in
// localStorage. Plain DOM, no framework; model text only ever reaches the page as text nodes (markdown.js).
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const KEY = { convs: "ds4py.chat.conversations", current: "ds4py.chat.current", settings: "ds4py.chat.settings",
                apiKey: "ds4py.chat.apiKey" };
  const DEFAULTS = { system: "", temperature: 1.0, top_p: 1.0, max_tokens: null, thinking: "high" };
  const EFFORT = { off: "none", high: "high", max: "max" };      // the page's switch -> reasoning_effort

  let convs = load(KEY.convs, []);
  let currentId = localStorage.getItem(KEY.current);
  let settings = Object.assign({}, DEFAULTS, load(KEY.settings, {}));
  let info = null;              // GET / (JSON): model id and name, backend, context
  let running = null;           // {controller, conv, msg} while an answer streams
  let renderQueued = false;

  function load(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v === null || v === undefined ? fallback : v;
    } catch (e) {
      return fallback;
    }
  }
  function save() {
    try {
      localStorage.setItem(KEY.convs, JSON.stringify(convs));
      if (currentId) localStorage.setItem(KEY.current, currentId);
      localStorage.setItem(KEY.settings, JSON.stringify(settings));
    } catch (e) {
      notice("Could not save the conversation in this browser's storage: " + e.message, true);
    }
  }
  function apiKey() { return localStorage.getItem(KEY.apiKey) || ""; }
  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const k = apiKey();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function notice(text, isError) {
    const n = $("notice");
    if (!text) { n.hidden = true; n.textContent = ""; return; }
    n.hidden = false;
    n.className = isError ? "error" : "";
    n.textContent = text;
  }

  // ---- conversations -------------------------------------------------------------------------------------
  function current() {
    let c = convs.find((x) => x.id === currentId);
    if (!c) c = newConversation();
    return c;
  }
  function newConversation() {
    const c = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat",
                created: Date.now(), messages: [] };
    convs.unshift(c);
    currentId = c.id;
    save();
    return c;
  }
  function titleFrom(text) {
    const t = text.replace(/\s+/g, " ").trim();
    return t.length > 48 ? t.slice(0, 47) + "\u2026" : t || "New chat";
  }

  function renderSidebar() {
    const ul = $("conversations");
    ul.replaceChildren();
    for (const c of convs) {
      const li = el("li", c.id === currentId ? "current" : "");
      li.dataset.id = c.id;
      const t = el("span", "title", c.title);
      t.title = c.title;
      t.addEventListener("click", () => { if (!running) { currentId = c.id; save(); renderAll(); } });
      const del = el("button", "delete", "\u00D7");
      del.title = "Delete this conversation";
      del.type = "button";
      del.addEventListener("click", () => {
        if (running && running.conv === c) return;
        convs = convs.filter((x) => x !== c);
        if (currentId === c.id) currentId = convs.length ? convs[0].id : null;
        save();
        renderAll();
      });
      li.append(t, del);
      ul.appendChild(li);
    }
  }

  // ---- messages -----------------------------------------------------------------------------------------
  function statsText(s) {
    const parts = [];
    if (s.completion_tokens !== undefined) parts.push(`${s.completion_tokens} tokens`);
    if (s.reasoning_tokens) parts.push(`${s.reasoning_tokens} thinking`);
    if (s.ttft_ms !== undefined) parts.push(`first token ${(s.ttft_ms / 1000).toFixed(2)} s`);
    if (s.tokens_per_s !== undefined && s.tokens_per_s !== null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
    if (s.prompt_tokens !== undefined) parts.push(`prompt ${s.prompt_tokens} (${s.cached_tokens || 0} cached)`);
    if (s.finish) parts.push(s.finish === "length" ? "stopped: max tokens" : s.finish);
    return parts.join(" \u00B7 ");
  }

  function messageNode(conv, msg, index) {
    const box = el("div", "msg " + msg.role);
    box.dataset.index = index;
    box.appendChild(el("div", "role", msg.role === "user" ? "You" : (info && info.model_id) || "assistant"));
    if (msg.role === "user") {
      box.appendChild(el("div", "body", msg.content));
      return box;
    }
    if (msg.reasoning) {
      const d = el("details", "reasoning");
      d.open = !!msg.pending && !msg.content;             // open while thinking; folded once the answer starts
      if (msg.reasoningOpen !== undefined) d.open = msg.reasoningOpen;
      d.addEventListener("toggle", () => { if (!msg.pending) msg.reasoningOpen = d.open; });   // the reader's choice
      d.appendChild(el("summary", "", msg.pending && !msg.content ? "Thinking\u2026" : "Thought"));
      d.appendChild(el("div", "reasoning-text", msg.reasoning));
      box.appendChild(d);
    }
    const body = el("div", "body");
    body.appendChild(window.ds4pyMarkdown.render(msg.content || ""));
    for (const call of msg.toolCalls || []) {
      const t = el("div", "tool-call");
      t.appendChild(el("div", "tool-name", "tool call: " + call.name));
      let args = call.arguments;
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* partial or not JSON: as sent */ }
      t.appendChild(el("pre", "", args));
      body.appendChild(t);
    }
    if (msg.pending) body.classList.add("cursor");
    box.appendChild(body);
    if (msg.error) box.appendChild(el("div", "error", msg.error));
    if (msg.stats) box.appendChild(el("div", "stats", statsText(msg.stats)));
    const last = index === conv.messages.length - 1;
    if (last && !msg.pending && !running) {
      const actions = el("div", "actions");
      const regen = el("button", "regenerate", "Regenerate");
      regen.type = "button";
      regen.addEventListener("click", regenerate);
      const edit = el("button", "edit", "Edit last message");
      edit.type = "button";
      edit.addEventListener("click", editLast);
      actions.append(regen, edit);
      box.appendChild(actions);
    }
    return box;
  }

  function renderMessages() {
    const conv = current();
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    box.replaceChildren();
    if (!conv.messages.length) {
      box.appendChild(el("div", "empty", info && info.model_note ? info.model_note : "Start a conversation."));
    }
    conv.messages.forEach((m, i) => box.appendChild(messageNode(conv, m, i)));
    if (atBottom || running) box.scrollTop = box.scrollHeight;
  }

  function renderAll() {
    renderSidebar();
    renderMessages();
    $("send").hidden = !!running;
    $("stop").hidden = !running;
    for (const r of document.querySelectorAll('input[name="thinking"]')) r.checked = r.value === settings.thinking;
  }

  function queueRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(() => { renderQueued = false; renderMessages(); });
  }

  // ---- talking to the server ------------------------------------------------------------------------------
  function apiMessages(conv) {
    const out = [];
    if (settings.system.trim()) out.push({ role: "system", content: settings.system });
    for (const m of conv.messages) {
      if (m.pending) continue;
      if (m.role === "user") out.push({ role: "user", content: m.content });
      else out.push({ role: "assistant", content: m.content || "" });  // reasoning is dropped by the template
    }
    return out;
  }

  async function explain(resp) {
    let message = "";
    try {
      const j = await resp.json();
      message = (j.error && (j.error.message || j.error)) || "";
    } catch (e) { /* not JSON */ }
    if (resp.status === 401) {
      return "The API key is missing or wrong: enter the server's key in Settings (it was started with --api-key).";
    }
    if (resp.status === 429) {
      const after = resp.headers.get("Retry-After");
      return `The server is busy (too many requests waiting)${after ? `; retry in ${after} s` : ""}.`;
    }
    if (resp.status === 503) {
      return /still loading/.test(message) ? "The model is still loading; try again in a few seconds."
                                           : "The server cannot answer: " + (message || "service unavailable");
    }
    return `Error ${resp.status}: ${message || resp.statusText}`;
  }

  async function generate(conv) {
    const msg = { role: "assistant", content: "", reasoning: "", toolCalls: [], pending: true };
    conv.messages.push(msg);
    const controller = new AbortController();
    running = { controller, conv, msg };
    renderAll();
    const body = { model: (info && info.model_id) || "deepseek-v4-flash", messages: apiMessages(conv),
                   stream: true, stream_options: { include_usage: true },
                   reasoning_effort: EFFORT[settings.thinking] || "high",
                   temperature: Number(settings.temperature), top_p: Number(settings.top_p) };
    if (settings.max_tokens) body.max_tokens = Number(settings.max_tokens);
    const t0 = performance.now();
    let tFirst = null;
    let tLast = null;
    const stats = {};
    try {
      const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true),
                                                         body: JSON.stringify(body), signal: controller.signal });
      if (!resp.ok) {
        msg.error = await explain(resp);
        if (resp.status === 401) openSettings(true);
        return;
      }
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      let done = false;
      while (!done) {
        const { value, done: end } = await reader.read();
        if (end) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;        // ": keep-alive" comments and the like
            const data = line.slice(5).trim();
            if (data === "[DONE]") { done = true; break; }
            const chunk = JSON.parse(data);
            if (chunk.error) { msg.error = "The server stopped this answer: " + chunk.error.message; continue; }
            if (chunk.usage) {
              stats.prompt_tokens = chunk.usage.prompt_tokens;
              stats.completion_tokens = chunk.usage.completion_tokens;
              stats.cached_tokens = (chunk.usage.prompt_tokens_details || {}).cached_tokens || 0;
              stats.reasoning_tokens = (chunk.usage.completion_tokens_details || {}).reasoning_tokens || 0;
            }
            for (const choice of chunk.choices || []) {
              const d = choice.delta || {};
              if (d.reasoning_content || d.content || d.tool_calls) {
                tLast = performance.now();
                if (tFirst === null) tFirst = tLast;
              }
              if (d.reasoning_content) msg.reasoning += d.reasoning_content;
              if (d.content) msg.content += d.content;
              for (const tc of d.tool_calls || []) {
                const slot = msg.toolCalls[tc.index] || (msg.toolCalls[tc.index] = { name: "", arguments: "" });
                if (tc.function && tc.function.name) slot.name = tc.function.name;
                if (tc.function && tc.function.arguments) slot.arguments += tc.function.arguments;
              }
              if (choice.finish_reason) stats.finish = choice.finish_reason;
            }
          }
        }
        queueRender();
      }
    } catch (e) {
      if (e.name === "AbortError") stats.finish = "stopped";
      else msg.error = "The connection to the server failed: " + e.message;
    } finally {
      if (tFirst !== null) {
        stats.ttft_ms = tFirst - t0;
        const n = stats.completion_tokens;
        stats.tokens_per_s = n > 1 && tLast > tFirst ? (n - 1) / ((tLast - tFirst) / 1000) : null;
      }
      if (Object.keys(stats).length) msg.stats = stats;
      delete msg.pending;
      running = null;
      save();
      renderAll();
      $("input").focus();
    }
  }

  function send() {
    const input = $("input");
    const text = input.value;
    if (running || !text.trim()) return;
    const conv = current();
    if (!conv.messages.length) conv.title = titleFrom(text);
    conv.messages.push({ role: "user", content: text });
    input.value = "";
    save();
    generate(conv);
  }

  function stop() {
    if (running) running.controller.abort();    // the server sees the disconnect and cancels the generation
  }

  function regenerate() {
    const conv = current();
    if (running || !conv.messages.length) return;
    if (conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
    if (conv.messages.length && conv.messages[conv.messages.length - 1].role === "user") generate(conv);
  }

  function editLast() {
    const conv = current();
    if (running) return;
    let i = conv.messages.length - 1;
    while (i >= 0 && conv.messages[i].role !== "user") i--;
    if (i < 0) return;
    $("input").value = conv.messages[i].content;
    conv.messages.splice(i);
    save();
    renderAll();
    $("input").focus();
  }

  // ---- header: model, backend, context, status -------------------------------------------------------------
  async function refreshInfo() {
    try {
      const resp = await fetch("/", { headers: Object.assign({ Accept: "application/json" }, headers(false)) });
      if (resp.status === 401) {
        setStatus("error", "API key needed");
        notice("This server needs an API key: enter it in Settings.", true);
        openSettings(true);
        return;
      }
      info = await resp.json();
      $("model-name").textContent = info.model || "ds4py";
      const bits = [];
      if (info.model_id) bits.push(info.model_id);
      if (info.backend) bits.push("backend " + info.backend);
      if (info.context_length) bits.push("context " + info.context_length.toLocaleString("en-US") + " tokens");
      $("model-info").textContent = bits.join(" \u00B7 ");
      if (info.status === "ok") {
        setStatus("ok", "ready");
        if (!$("notice").classList.contains("error") || /loading|API key/.test($("notice").textContent)) notice("");
      } else if (info.status === "loading") {
        setStatus("loading", "loading the model\u2026");
        notice("The model is still loading; the page will be ready when it is.");
        setTimeout(refreshInfo, 2000);
      } else {
        setStatus("error", "error");
        notice("The model failed to load: " + (info.error || "see the server's log"), true);
      }
      if (!current().messages.length) renderMessages();
    } catch (e) {
      setStatus("error", "server unreachable");
      setTimeout(refreshInfo, 5000);
    }
  }
  function setStatus(kind, text) {
    const s = $("server-status");
    s.className = "status " + kind;
    s.textContent = text;
  }

  // ---- settings -------------------------------------------------------------------------------------------
  function openSettings(focusKey) {
    $("set-system").value = settings.system;
    $("set-temperature").value = settings.temperature;
    $("set-top-p").value = settings.top_p;
    $("set-max-tokens").value = settings.max_tokens || "";
    $("set-api-key").value = apiKey();
    const d = $("settings");
    if (!d.open) d.showModal();
    if (focusKey === true) $("set-api-key").focus();
  }
  function clamp(v, lo, hi, fallback) {
    const x = Number(v);
    return Number.isFinite(x) ? Math.min(hi, Math.max(lo, x)) : fallback;
  }
  function saveSettings() {
    settings.system = $("set-system").value;
    settings.temperature = clamp($("set-temperature").value, 0, 2, DEFAULTS.temperature);
    settings.top_p = clamp($("set-top-p").value, 0.01, 1, DEFAULTS.top_p);
    const mt = parseInt($("set-max-tokens").value, 10);
    settings.max_tokens = Number.isFinite(mt) && mt >= 1 ? mt : null;
    const k = $("set-api-key").value.trim();
    if (k) localStorage.setItem(KEY.apiKey, k); else localStorage.removeItem(KEY.apiKey);
    save();
    refreshInfo();
  }

  // ---- wiring ---------------------------------------------------------------------------------------------
  function init() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", () => {
      if (running) return;
      const c = current();
      if (c.messages.length) newConversation(); else currentId = c.id;
      renderAll();
      $("input").focus();
    });
    $("toggle-sidebar").addEventListener("click", () => {
      $("sidebar").classList.toggle(window.innerWidth > 700 ? "hidden" : "shown");
    });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && running && !$("settings").open) { e.preventDefault(); stop(); }
    });
    for (const r of document.querySelectorAll('input[name="thinking"]')) {
      r.addEventListener("change", () => { if (r.checked) { settings.thinking = r.value; save(); } });
    }
    $("open-settings").addEventListener("click", () => openSettings(false));
    $("settings-save").addEventListener("click", saveSettings);
    $("settings-reset").addEventListener("click", () => {
      $("set-system").value = DEFAULTS.system;
      $("set-temperature").value = DEFAULTS.temperature;
      $("set-top-p").value = DEFAULTS.top_p;
      $("set-max-tokens").value = "";
    });
    // an answer cut off by a reload is kept as far as it got
    for (const c of convs) for (const m of c.messages) if (m.pending) { delete m.pending; m.error = "interrupted"; }
    current();
    save();
    renderAll();
    refreshInfo();
    $("input").focus();
  }

  window.ds4pyChat = { send, stop, regenerate, editLast, settings: () => settings, state: () => ({ convs, currentId, running: !!running }) };
  init();
})();
