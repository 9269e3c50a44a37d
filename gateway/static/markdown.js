// A tiny, safe Markdown renderer: paragraphs, headings, fenced code, inline code, bold, italic,
// lists and http(s) links. Everything is HTML-escaped first; the only tags in the output are the
// ones made here, so model output can never inject markup.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
}

// Inline spans of one line of already-split text. Code spans are cut out first so that their
// contents are not touched by the emphasis rules.
export function renderInline(text) {
  const parts = String(text).split(/(`+[^`]*?`+)/g);
  return parts
    .map((part, i) => {
      if (i % 2 === 1) {
        const code = part.replace(/^`+|`+$/g, "");
        return `<code>${escapeHtml(code)}</code>`;
      }
      let html = escapeHtml(part);
      html = html.replace(
        /\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
        (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`,
      );
      html = html.replace(/\*\*(?=\S)(.+?)\*\*/g, "<strong>$1</strong>");
      html = html.replace(/__(?=\S)(.+?)__/g, "<strong>$1</strong>");
      html = html.replace(/(^|[^*])\*(?=\S)([^*]+?)\*/g, "$1<em>$2</em>");
      html = html.replace(/(^|[^\w_])_(?=\S)([^_]+?)_(?!\w)/g, "$1<em>$2</em>");
      return html;
    })
    .join("");
}

const FENCE = /^\s*(```|~~~)\s*([\w+-]*)\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const ORDERED = /^\s*(\d+)[.)]\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;

function isBlockStart(line) {
  return FENCE.test(line) || BULLET.test(line) || ORDERED.test(line) || HEADING.test(line);
}

// Block structure. An unterminated code fence (still streaming) runs to the end of the text.
export function renderMarkdown(source) {
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1; // the closing fence, if any
      const lang = fence[2] ? ` class="lang-${escapeHtml(fence[2])}"` : "";
      out.push(`<pre><code${lang}>${escapeHtml(body.join("\n"))}</code></pre>`);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const level = Math.min(heading[1].length + 2, 6); // keep headings small inside a chat
      out.push(`<h${level}>${renderInline(heading[2])}</h${level}>`);
      i += 1;
      continue;
    }
    if (BULLET.test(line) || ORDERED.test(line)) {
      const ordered = !BULLET.test(line);
      const pattern = ordered ? ORDERED : BULLET;
      const items = [];
      while (i < lines.length && pattern.test(lines[i])) {
        const match = pattern.exec(lines[i]);
        items.push(`<li>${renderInline(ordered ? match[2] : match[1])}</li>`);
        i += 1;
      }
      const tag = ordered ? "ol" : "ul";
      out.push(`<${tag}>${items.join("")}</${tag}>`);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !isBlockStart(lines[i])) para.push(lines[i++]);
    out.push(`<p>${para.map(renderInline).join("<br>")}</p>`);
  }
  return out.join("\n");
}
