"use strict";
// The search page of `retr-train serve` (routes: trainers/search/serve_app.py); plain DOM, no build step.
// Text from the server goes in as text; only the summary and attention fragments are HTML (the report's,
// escaped by the server). One request runs at a time: while it does, the controls are disabled, the results
// dimmed and a spinner turns; its answer (results, or one error line) then replaces what was shown before.
const $ = (id) => document.getElementById(id);
const GALLERY_PAGE = 24;          // gallery thumbnails shown per "Show more"
let info = { explains: [], top: 10, ids: [], model: "" };
let current = null;               // the AbortController of the request under way
let galleryShown = 0;

/** An element: attributes (on* keys are listeners) and children (strings become text). */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined && c !== ""));
  return node;
}

function say(text, kind) {
  $("message").textContent = text;
  $("message").className = kind || "";
}

const imageUrl = (id) => "image/" + encodeURIComponent(id);
const count = () => $("top").value.trim() || String(info.top);
const score = (value) => value.toFixed(4);

async function call(url, options) {
  let response;
  try {
    response = await fetch(url, options);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new Error("the server did not answer: is retr-train serve still running?");
  }
  let body = null;
  try { body = await response.json(); } catch (err) { body = null; }
  if (!response.ok) throw new Error(body && body.error ? body.error : `the server answered ${response.status} ${response.statusText}`);
  return body;
}

function setBusy(busy) {
  document.body.classList.toggle("busy", busy);
  $("controls").disabled = busy;
  $("spinner").hidden = !busy;
  $("results").setAttribute("aria-busy", String(busy));
}

/** Run one request: busy while it runs; its rendering, or its error, replaces the results (never both). */
async function request(what, url, options, render, target) {
  if (current) current.abort();
  const controller = new AbortController();
  current = controller;
  const focused = document.activeElement;
  setBusy(true);
  say(what + "…", "busy");
  try {
    const body = await call(url, { ...(options || {}), signal: controller.signal });
    if (current !== controller) return;
    render(body);
    say("");
  } catch (err) {
    if (current !== controller || err.name === "AbortError") return;
    (target || $("results")).replaceChildren();
    if (!target) $("attention").replaceChildren();
    say(err.message, "error");
  } finally {
    if (current === controller) {
      current = null;
      setBusy(false);
      document.body.dataset.answered = String(Number(document.body.dataset.answered || 0) + 1);   // for scripts, tests
      if (focused && focused.isConnected && document.activeElement === document.body) focused.focus();
    }
  }
}

// -- modes ---------------------------------------------------------------------------------------------------
function mode() { return $("mode-image").checked ? "image" : "text"; }

function setMode(name) {
  $("mode-" + name).checked = true;
  $("text-form").hidden = name !== "text";
  $("image-panel").hidden = name !== "image";
}

function activeForm() { return mode() === "text" ? $("text-form") : $("image-form"); }

// -- text → images ---------------------------------------------------------------------------------------------
function explainButton(imageId, params, pair) {
  if (!info.explains.length) return null;
  return el("button", { type: "button", class: "explain", title: "draw the model's attention for this pair",
    onclick: (event) => { event.stopPropagation(); explain(imageId, params, pair); } }, "attention");
}

/** A result image: a focusable tile (click, Enter or Space searches the captions of its image). */
function imageTile(hit, queryText) {
  const open = () => searchWithImage(hit.image_id);
  const tile = el("figure", {
    class: "tile hit", tabindex: "0", role: "button", "data-image-id": hit.image_id, "data-score": hit.score,
    "aria-label": `result ${hit.rank}: image ${hit.image_id}, score ${score(hit.score)}; find its captions`,
    onclick: open,
    onkeydown: (event) => {
      if (event.target === tile && (event.key === "Enter" || event.key === " ")) { event.preventDefault(); open(); }
    },
  },
  el("div", { class: "frame" }, el("img", { src: imageUrl(hit.image_id), alt: hit.image_id, loading: "lazy" }),
    el("span", { class: "rank" }, "#" + hit.rank)),
  el("figcaption", {},
    el("span", { class: "score", title: "score" }, score(hit.score)),
    el("span", { class: "id" }, hit.image_id),
    explainButton(hit.image_id, { caption: queryText }, `«${queryText}» and ${hit.image_id}`)));
  return tile;
}

function showImages(result) {
  const grid = el("div", { class: "grid", id: "hits" }, ...result.hits.map((hit) => imageTile(hit, result.query)));
  const unknown = result.unknown_words.length ?
    el("p", { class: "note" }, "not in the run's vocabulary (read as <unk>): " + result.unknown_words.join(", ")) : "";
  $("results").replaceChildren(
    el("div", { class: "results-head" }, el("h2", {}, `Images for «${result.query}»`),
      el("span", { class: "small" }, `${result.hits.length} of ${info.images} · click an image for its captions`)),
    unknown, grid);
  $("attention").replaceChildren();
}

function searchImages(text) {
  return request("searching", "api/search?" + new URLSearchParams({ q: text, k: count() }), null, showImages);
}

// -- image → captions ------------------------------------------------------------------------------------------
function showCaptions(result, src, label, imageId) {
  const scores = result.hits.map((h) => h.score);
  const low = Math.min(...scores), high = Math.max(...scores);
  const list = el("ol", { id: "hits", class: "captions" });
  for (const hit of result.hits) {
    const truth = imageId !== null && hit.image_id === imageId;
    const width = high > low ? 15 + 85 * (hit.score - low) / (high - low) : 100;
    const thumb = el("button", { type: "button", class: "mini", title: `search with image ${hit.image_id}`,
      onclick: () => searchWithImage(hit.image_id) }, el("img", { src: imageUrl(hit.image_id), alt: hit.image_id, loading: "lazy" }));
    list.append(el("li", { class: "hit caption" + (truth ? " truth" : ""), "data-caption-index": hit.caption_index,
      "data-score": hit.score },
    el("span", { class: "rank" }, "#" + hit.rank),
    thumb,
    el("div", { class: "body" },
      el("p", { class: "text" }, `«${hit.caption}»`, truth ? el("span", { class: "tick", title: "a caption of this image" }, " ✓") : null),
      el("div", { class: "meter", "aria-hidden": "true" }, el("span", { style: `width: ${width.toFixed(1)}%` })),
      el("p", { class: "small" }, el("span", { class: "score" }, score(hit.score)), ` · from ${hit.image_id}`)),
    el("div", { class: "actions" },
      el("button", { type: "button", class: "as-query", title: "search images with this caption",
        onclick: () => { setMode("text"); $("query").value = hit.caption; searchImages(hit.caption); } }, "find images"),
      imageId !== null ? explainButton(imageId, { caption_index: hit.caption_index }, `«${hit.caption}» and ${imageId}`) : null)));
  }
  const note = imageId === null ? el("p", { class: "small" }, "attention maps are drawn for gallery images only") : "";
  $("results").replaceChildren(
    el("div", { class: "i2t" },
      el("figure", { class: "query-image" }, el("img", { src: src, alt: label }), el("figcaption", {}, label)),
      el("div", { class: "i2t-list" },
        el("div", { class: "results-head" }, el("h2", {}, "Captions for ", el("span", { class: "name" }, label)),
          el("span", { class: "small" }, `${result.hits.length} of ${info.captions}`)),
        list, note)));
  $("attention").replaceChildren();
}

function findCaptions(imageId) {
  return request("searching", "api/captions?" + new URLSearchParams({ image: imageId, k: count() }), null,
    (result) => showCaptions(result, imageUrl(imageId), imageId, imageId));
}

/** Search with a gallery image: the image mode, its id in the field, its captions. */
function searchWithImage(imageId) {
  setMode("image");
  $("image-id").value = imageId;
  return findCaptions(imageId);
}

let uploadedUrl = null;            // the object URL of the upload shown (revoked when another replaces it)

function uploadImage(file) {
  $("upload-name").textContent = file.name;
  setMode("image");
  const form = new FormData();
  form.append("image", file, file.name);
  return request("uploading " + file.name, "api/captions?" + new URLSearchParams({ k: count() }),
    { method: "POST", body: form },
    (result) => {
      if (uploadedUrl) URL.revokeObjectURL(uploadedUrl);
      uploadedUrl = URL.createObjectURL(file);
      showCaptions(result, uploadedUrl, result.query || file.name, null);
    });
}

// -- attention -------------------------------------------------------------------------------------------------
function explain(imageId, params, pair) {
  const box = $("attention");
  return request("drawing the attention maps", "api/explain?" + new URLSearchParams({ image: imageId, ...params }), null,
    (body) => {
      const fragment = el("div", { class: "fragment" });
      fragment.innerHTML = body.html;
      box.replaceChildren(el("div", { class: "results-head" },
        el("h2", {}, `Attention of ${body.model || info.model}: `, el("span", { class: "name" }, pair)),
        el("button", { type: "button", class: "close", onclick: () => box.replaceChildren() }, "close")), fragment);
      box.scrollIntoView({ block: "start" });
    }, box);
}

// -- the gallery picker ------------------------------------------------------------------------------------------
function showMoreGallery() {
  const next = info.ids.slice(galleryShown, galleryShown + GALLERY_PAGE);
  $("gallery").append(...next.map((id) => el("button", { type: "button", class: "pick", "data-image-id": id,
    title: id, "aria-label": `find the captions of ${id}`, onclick: () => searchWithImage(id) },
  el("img", { src: imageUrl(id), alt: id, loading: "lazy" }))));
  galleryShown += next.length;
  $("gallery-more").hidden = galleryShown >= info.ids.length;
}

// -- wiring ----------------------------------------------------------------------------------------------------
$("text-form").addEventListener("submit", (event) => { event.preventDefault(); searchImages($("query").value); });
$("image-form").addEventListener("submit", (event) => { event.preventDefault(); findCaptions($("image-id").value.trim()); });
for (const radio of document.querySelectorAll("input[name=mode]")) {
  radio.addEventListener("change", () => setMode(radio.value));
}
$("top").addEventListener("keydown", (event) => {
  if (event.key === "Enter") { event.preventDefault(); activeForm().requestSubmit(); }
});
$("upload").addEventListener("change", () => {
  if ($("upload").files.length) uploadImage($("upload").files[0]);
  $("upload").value = "";
});
$("drop").addEventListener("dragover", (event) => { event.preventDefault(); $("drop").classList.add("over"); });
$("drop").addEventListener("dragleave", () => $("drop").classList.remove("over"));
$("drop").addEventListener("drop", (event) => {
  event.preventDefault();
  $("drop").classList.remove("over");
  if (!$("controls").disabled && event.dataTransfer.files.length) uploadImage(event.dataTransfer.files[0]);
});
$("gallery-box").addEventListener("toggle", () => { if ($("gallery-box").open && !galleryShown) showMoreGallery(); });
$("gallery-more").addEventListener("click", showMoreGallery);

call("api/info").then((body) => {
  info = body;
  const model = body.model && body.model !== body.run ? ` (${body.model})` : "";
  $("run").replaceChildren(el("b", {}, body.run + model),
    ` · images: ${body.gallery} (${body.images}) · captions: the split's (${body.captions})`);
  $("top").value = body.top;
  $("top").max = body.max_k || 100;
  $("gallery-ids").replaceChildren(...body.ids.map((id) => el("option", { value: id })));
  $("gallery-box").querySelector("summary").textContent = `Pick an image of the gallery (${body.images})`;
  $("summary").innerHTML = body.summary_html;
  $("controls").disabled = false;
  document.body.dataset.ready = "1";
}, (err) => say(err.message, "error"));
