// Server-Sent Events over fetch(): unlike EventSource this can send an Authorization header and be
// cancelled with an AbortController. `onEvent({event, data})` is called for every complete event.

export async function readSse(response, onEvent) {
  await readFrames(response, "\n\n", (block) => {
    const parsed = parseBlock(block);
    if (parsed) onEvent(parsed);
  });
}

// Call onFrame(text) for every piece of the response body between separators (line ends made
// "\n" first), and once for what is left after the last one (maybe ""). Shared by the SSE
// reader here and the NDJSON one in copy.js.
export async function readFrames(response, separator, onFrame) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf(separator)) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + separator.length);
      onFrame(frame);
    }
  }
  onFrame(buffer);
}

function parseBlock(block) {
  let event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  return { event, data: data.join("\n") };
}
