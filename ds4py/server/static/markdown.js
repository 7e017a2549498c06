// Markdown to DOM nodes for the chat page, safely: every piece of model text becomes a text node
// (textContent / createTextNode), never HTML, so markup in an answer is shown as the characters it is.
// Covers what chat answers use: paragraphs, headings, fenced code, lists, quotes, rules, tables of pipes,
// inline code, bold, italic, strike-through and http(s) links. Unclosed constructs (a fence still streaming)
// render as far as they go.
"use strict";

(function () {
  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$/;
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function el(tag, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  }

  // ---- inline -----------------------------------------------------------------------------------------
  // earliest match wins; the text between matches is plain text
  const INLINE = [
    { re: /(`+)([\s\S]*?[^`])\1(?!`)/y, make: (m) => { const c = el("code"); c.textContent = m[2].replace(/^ (.*) $/, "$1"); return c; } },
    { re: /\*\*(?=\S)([\s\S]*?\S)\*\*/y, make: (m) => wrap("strong", m[1]) },
    { re: /__(?=\S)([\s\S]*?\S)__(?![A-Za-z0-9])/y, make: (m) => wrap("strong", m[1]) },
    { re: /~~(?=\S)([\s\S]*?\S)~~/y, make: (m) => wrap("del", m[1]) },
    { re: /\*(?=[^\s*])([\s\S]*?[^\s*])\*/y, make: (m) => wrap("em", m[1]) },
    { re: /_(?=[^\s_])([\s\S]*?[^\s_])_(?![A-Za-z0-9])/y, make: (m) => wrap("em", m[1]) },
    { re: /\[([^\]\n]+)\]\(([^)\s]+)\)/y, make: (m) => link(m[1], m[2]) },
    { re: /https?:\/\/[^\s<>()"']+[^\s<>()"'.,;:!?]/y, make: (m) => link(null, m[0]) },
  ];
  const STARTS = /[`*_~\[h]/g;

  function wrap(tag, text) {
    const e = el(tag);
    e.appendChild(inline(text));
    return e;
  }

  function link(label, url) {
    if (!SAFE_URL.test(url)) {               // javascript:, data:, relative: shown as text, not followed
      return document.createTextNode(label === null ? url : `[${label}](${url})`);
    }
    const a = el("a");
    a.href = url;
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    if (label === null) a.textContent = url;
    else a.appendChild(inline(label));
    return a;
  }

  function inline(text) {
    const frag = document.createDocumentFragment();
    let plain = 0;
    let i = 0;
    STARTS.lastIndex = 0;
    while (i < text.length) {
      STARTS.lastIndex = i;
      const s = STARTS.exec(text);
      if (!s) break;
      i = s.index;
      let node = null;
      for (const rule of INLINE) {
        rule.re.lastIndex = i;
        const m = rule.re.exec(text);
        if (m) {
          node = rule.make(m);
          if (plain < i) frag.appendChild(document.createTextNode(text.slice(plain, i)));
          frag.appendChild(node);
          i += m[0].length;
          plain = i;
          break;
        }
      }
      if (!node) i += 1;
    }
    if (plain < text.length) frag.appendChild(document.createTextNode(text.slice(plain)));
    return frag;
  }

  function inlineLines(lines) {
    // a single newline inside a paragraph is a line break (chat answers mean it)
    const frag = document.createDocumentFragment();
    lines.forEach((line, k) => {
      if (k) frag.appendChild(el("br"));
      frag.appendChild(inline(line));
    });
    return frag;
  }

  // ---- blocks -----------------------------------------------------------------------------------------
  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|")) s = s.slice(0, -1);
    return s.split("|").map((c) => c.trim());
  }

  function blocks(lines) {
    const frag = document.createDocumentFragment();
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(fence) && lines[i].trim().replace(/[`~]/g, "") === "")) {
          body.push(lines[i]);
          i++;
        }
        i++;                                   // the closing fence (or past the end while streaming)
        const pre = el("pre", "code-block");
        if (m[2]) pre.dataset.lang = m[2];
        const code = el("code");
        code.textContent = body.join("\n");
        pre.appendChild(code);
        frag.appendChild(pre);
        continue;
      }
      if ((m = HEADING.exec(line))) {
        const h = el("h" + Math.min(6, m[1].length + 2));    // h3..h6: answers sit under the page's own headings
        h.appendChild(inline(m[2]));
        frag.appendChild(h);
        i++;
        continue;
      }
      if (RULE.test(line)) { frag.appendChild(el("hr")); i++; continue; }
      if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) { inner.push(m[1]); i++; }
        const q = el("blockquote");
        q.appendChild(blocks(inner));
        frag.appendChild(q);
        continue;
      }
      if ((m = ITEM.exec(line))) {
        const ordered = /\d/.test(m[2]);
        const list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[2], 10) !== 1) list.start = parseInt(m[2], 10);
        const indent = m[1].length;
        let item = null;
        let body = [];
        const flush = () => { if (item) { item.appendChild(blocks(body)); list.appendChild(item); } };
        while (i < lines.length) {
          const l = lines[i];
          const im = ITEM.exec(l);
          if (im && im[1].length <= indent && /\d/.test(im[2]) === ordered) {
            flush();
            item = el("li");
            body = [im[3]];
          } else if (l.trim() && (/^\s/.test(l) || !(FENCE.test(l) || HEADING.test(l) || ITEM.test(l) || QUOTE.test(l)))) {
            body.push(l.replace(/^\s{1,4}/, ""));
          } else if (!l.trim() && i + 1 < lines.length && /^\s+\S/.test(lines[i + 1])) {
            body.push("");
          } else {
            break;
          }
          i++;
        }
        flush();
        frag.appendChild(list);
        continue;
      }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        const table = el("table");
        const head = el("tr");
        for (const c of splitRow(line)) { const th = el("th"); th.appendChild(inline(c)); head.appendChild(th); }
        const thead = el("thead");
        thead.appendChild(head);
        table.appendChild(thead);
        const tbody = el("tbody");
        i += 2;
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
          const tr = el("tr");
          for (const c of splitRow(lines[i])) { const td = el("td"); td.appendChild(inline(c)); tr.appendChild(td); }
          tbody.appendChild(tr);
          i++;
        }
        table.appendChild(tbody);
        frag.appendChild(table);
        continue;
      }
      const para = [];
      while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) &&
             !RULE.test(lines[i]) && !QUOTE.test(lines[i]) && !(para.length && ITEM.test(lines[i]))) {
        para.push(lines[i]);
        i++;
      }
      if (!para.length) { para.push(line); i++; }
      const p = el("p");
      p.appendChild(inlineLines(para));
      frag.appendChild(p);
    }
    return frag;
  }

  // the page's entry point: a fragment of DOM nodes for `text`
  function render(text) {
    return blocks(String(text).replace(/\r\n?/g, "\n").split("\n"));
  }

  window.ds4pyMarkdown = { render };
})();
