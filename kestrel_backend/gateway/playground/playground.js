// The playground: one image, one skill, the answer streamed and drawn on the image. Plain JavaScript, served by the
// gateway itself (no CDN, no build step). Answers are shown as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const state = { image: null, dataUrl: null, width: 0, height: 0 };

// --- the API key and the server's readiness ---

$("key").value = localStorage.getItem("kestrel-key") || "";
$("key").addEventListener("change", () => localStorage.setItem("kestrel-key", $("key").value.trim()));

function headers() {
  const key = $("key").value.trim();
  return key ? { "Content-Type": "application/json", "X-Moondream-Auth": key } : { "Content-Type": "application/json" };
}

async function checkReady() {
  const status = $("status");
  try {
    const answer = await fetch("/readyz");
    const body = await answer.json();
    status.textContent = answer.ok ? "server ready" : `server not ready: ${body.status}`;
    status.className = answer.ok ? "status ready" : "status down";
  } catch (e) {
    status.textContent = "server unreachable";
    status.className = "status down";
  }
}
checkReady();
setInterval(checkReady, 3000);

// --- the image ---

function useFile(file) {
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => {
    state.dataUrl = reader.result;
    const img = $("image");
    img.onload = () => {
      state.width = img.naturalWidth;
      state.height = img.naturalHeight;
      $("stage").hidden = false;
      $("hint").hidden = true;
      clearOverlay();
    };
    img.src = state.dataUrl;
  };
  reader.readAsDataURL(file);
}

$("file").addEventListener("change", (e) => useFile(e.target.files[0]));
const drop = $("drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  useFile(e.dataTransfer.files[0]);
});

// a click on the image sets the eye for gaze
$("overlay").addEventListener("click", (e) => {
  if ($("skill").value !== "gaze") return;
  const r = e.currentTarget.getBoundingClientRect();
  const x = (e.clientX - r.left) / r.width, y = (e.clientY - r.top) / r.height;
  $("eye").value = `${x.toFixed(3)}, ${y.toFixed(3)}`;
  clearOverlay();
  drawEye(x, y);
});

// --- the form ---

function showFields() {
  const skill = $("skill").value;
  for (const label of document.querySelectorAll("[data-for]")) {
    label.hidden = !label.dataset.for.split(" ").includes(skill);
  }
  $("textName").textContent = { query: "Question", chat: "Message" }[skill] || "Object";
  $("overlay").style.cursor = skill === "gaze" ? "crosshair" : "";
  const text = $("text");
  if (["detect", "point", "segment"].includes(skill) && text.value.endsWith("?")) text.value = "face";
  if (["query", "chat"].includes(skill) && !text.value.endsWith("?")) text.value = "What is in this image?";
}
$("skill").addEventListener("change", showFields);
showFields();

function request(skill) {
  const text = $("text").value, settings = { max_tokens: Number($("maxTokens").value) || 128 };
  const image = state.dataUrl;
  if (skill === "chat") {
    const content = [{ type: "text", text }];
    if (image) content.unshift({ type: "image_url", image_url: { url: image } });
    return { path: "/v1/chat/completions", stream: true, body: {
      messages: [{ role: "user", content }], stream: true, stream_options: { include_usage: true },
      reasoning: $("reasoning").checked, max_tokens: settings.max_tokens } };
  }
  if (skill === "query") {
    return { path: "/v1/query", stream: true, body: { image_url: image, question: text, reasoning:
      $("reasoning").checked, stream: true, settings } };
  }
  if (skill === "caption") {
    return { path: "/v1/caption", stream: true, body: { image_url: image, length: $("length").value, stream: true,
      settings } };
  }
  if (skill === "gaze") {
    const [x, y] = $("eye").value.split(",").map(Number);
    return { path: "/v1/gaze", stream: false, body: { image_url: image, eye: { x, y } } };
  }
  if (skill !== "segment") settings.max_objects = Number($("maxObjects").value) || 20;
  return { path: `/v1/${skill}`, stream: false, body: { image_url: image, object: text, settings } };
}

$("form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const skill = $("skill").value;
  if (!state.dataUrl && skill !== "chat" && skill !== "query") {
    showError(`${skill} needs an image: drop or pick one first`);
    return;
  }
  const call = request(skill);
  showCalls(call);
  clearOverlay();
  $("answer").textContent = "";
  $("answer").className = "answer";
  $("metrics").textContent = "";
  $("result").textContent = "";
  $("run").disabled = true;
  const t0 = performance.now();
  try {
    const answer = await fetch(call.path, { method: "POST", headers: headers(), body: JSON.stringify(call.body) });
    if (!answer.ok) {
      const body = await answer.json().catch(() => ({}));
      throw new Error(`${answer.status}: ${(body.error && body.error.message) || answer.statusText}`);
    }
    const result = call.stream ? await readStream(answer, skill, t0) : await answer.json();
    showResult(skill, result, performance.now() - t0);
  } catch (err) {
    showError(err.message);
  } finally {
    $("run").disabled = false;
  }
});

// Server-sent events: the Moondream API's {"chunk", "completed"} or OpenAI's chat.completion.chunk
async function readStream(answer, skill, t0) {
  const reader = answer.body.getReader(), decoder = new TextDecoder();
  let buffer = "", final = null, text = "", firstChunkMs = null, usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") continue;
      const body = JSON.parse(data);
      if (body.error) throw new Error(body.error.message);
      if (firstChunkMs === null) firstChunkMs = performance.now() - t0;
      if (skill === "chat") {
        const delta = (body.choices && body.choices[0] && body.choices[0].delta) || {};
        if (delta.content) { text += delta.content; $("answer").textContent = text; }
        if (body.usage) usage = body.usage;
      } else if (body.completed) {
        final = body;
      } else {
        text += body.chunk || "";
        $("answer").textContent = text;
      }
    }
  }
  const result = final || { answer: text, usage };
  result.client_first_chunk_ms = firstChunkMs;
  return result;
}

// --- results ---

function showResult(skill, result, ms) {
  $("result").textContent = JSON.stringify(result, null, 1);
  const answer = result.answer ?? result.caption ?? (result.reasoning && result.reasoning.text) ?? "";
  if (typeof answer === "string" && answer) $("answer").textContent = answer;
  if (result.objects) { $("answer").textContent = `${result.objects.length} object(s)`; result.objects.forEach(drawBox); }
  if (result.points) { $("answer").textContent = `${result.points.length} point(s)`; result.points.forEach(drawPoint); }
  if (skill === "segment") {
    $("answer").textContent = result.path ? "outline drawn" : "no outline";
    if (result.path && result.bbox) drawMask(result.path, result.bbox);
  }
  if (skill === "gaze") {
    const [x, y] = $("eye").value.split(",").map(Number);
    drawEye(x, y);
    $("answer").textContent = result.gaze ? `looking at (${result.gaze.x.toFixed(3)}, ${result.gaze.y.toFixed(3)})` :
      "no gaze found";
    if (result.gaze) drawGaze(x, y, result.gaze.x, result.gaze.y);
  }
  const metrics = { ...(result.metrics || {}), ...(result.usage || {}), client_total_ms: Math.round(ms) };
  if (result.client_first_chunk_ms != null) metrics.client_first_chunk_ms = Math.round(result.client_first_chunk_ms);
  for (const [k, v] of Object.entries(metrics)) {
    if (typeof v === "object") continue;
    const row = $("metrics").insertRow();
    row.insertCell().textContent = k;
    row.insertCell().textContent = String(v);
  }
}

function showError(message) {
  $("answer").textContent = message;
  $("answer").className = "answer error";
}

function showCalls(call) {
  const body = JSON.parse(JSON.stringify(call.body));
  const elide = (v) => (typeof v === "string" && v.startsWith("data:") ? "data:image/jpeg;base64,<your image>" : v);
  if (body.image_url) body.image_url = elide(body.image_url);
  for (const m of body.messages || []) for (const p of m.content || []) if (p.image_url) p.image_url.url = elide(p.image_url.url);
  const key = $("key").value.trim() ? " -H 'X-Moondream-Auth: <key>'" : "";
  $("curl").textContent = `curl ${location.origin}${call.path}${key} -H 'Content-Type: application/json' \\\n  -d '${JSON.stringify(body)}'`;
  const skill = $("skill").value, text = JSON.stringify($("text").value);
  const lines = ["import moondream as md", "from PIL import Image",
    `model = md.vl(endpoint="${location.origin}/v1"${key ? ', api_key="<key>"' : ""})`,
    'image = Image.open("your image.jpg")'];
  const calls = {
    query: `model.query(image, ${text}${$("reasoning").checked ? ", reasoning=True" : ""})`,
    caption: `model.caption(image, length="${$("length").value}")`,
    detect: `model.detect(image, ${text})`, point: `model.point(image, ${text})`,
    segment: `model.segment(image, ${text})`,
    chat: `model.chat([{"role": "user", "content": ${text}}])`,
  };
  lines.push(calls[skill] || "# gaze: the gateway's own /v1/gaze (ours; the official client has none): curl above");
  $("python").textContent = lines.join("\n");
}

// --- the overlay (coordinates in [0, 1] of the image) ---

function clearOverlay() { $("overlay").replaceChildren(); }

function add(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  $("overlay").appendChild(el);
  return el;
}

function drawBox(b) {
  add("rect", { class: "box", x: b.x_min, y: b.y_min, width: Math.max(b.x_max - b.x_min, 0),
                height: Math.max(b.y_max - b.y_min, 0) });
}

// circles in a square-pixel sense: the overlay stretches [0, 1] over both sides, so an ellipse keeps them round
function dot(cls, x, y, radiusPx) {
  add("ellipse", { class: cls, cx: x, cy: y, rx: radiusPx / $("image").clientWidth,
                   ry: radiusPx / $("image").clientHeight });
}

function drawPoint(p) { dot("point", p.x, p.y, 6); }
function drawEye(x, y) { dot("eye", x, y, 5); }

function drawGaze(x, y, gx, gy) {
  add("line", { class: "gaze", x1: x, y1: y, x2: gx, y2: gy });
  dot("target", gx, gy, 6);
}

function drawMask(path, b) {
  add("path", { class: "mask", d: path,
                transform: `translate(${b.x_min},${b.y_min}) scale(${b.x_max - b.x_min},${b.y_max - b.y_min})` });
}
