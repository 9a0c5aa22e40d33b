"use strict";
// The search page of `retr-train serve` (routes: trainers/search/serve_app.py). Text from the server goes in as
// text; only the summary and attention fragments are HTML (the report's, escaped by the server).
const $ = (id) => document.getElementById(id);
let info = { explains: [], top: 10 };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

function say(text, kind) {
  $("message").textContent = text;
  $("message").className = kind || "";
}

async function call(url, options) {
  const response = await fetch(url, options);
  let body = null;
  try { body = await response.json(); } catch (err) { body = null; }
  if (!response.ok) throw new Error(body && body.error ? body.error : `HTTP ${response.status} ${response.statusText}`);
  return body;
}

function count() { return $("top").value || String(info.top); }
const imageUrl = (id) => "image/" + encodeURIComponent(id);

function explainButton(image, params) {
  const button = el("button", { type: "button", class: "explain" }, "attention");
  button.addEventListener("click", () => explain(image, params));
  return info.explains.length ? button : "";
}

async function run(what, action) {
  say(what + "…", "busy");
  $("attention").replaceChildren();
  try { await action(); say(""); } catch (err) { say(err.message, "error"); }
}

function searchImages(text) {
  return run("searching", async () => {
    const result = await call("api/search?" + new URLSearchParams({ q: text, k: count() }));
    const box = el("div", { class: "grid", id: "hits" });
    for (const hit of result.hits) {
      const img = el("img", { src: imageUrl(hit.image_id), alt: hit.image_id, title: "find this image's captions" });
      img.addEventListener("click", () => { $("image-id").value = hit.image_id; findCaptions(hit.image_id); });
      box.append(el("figure", { class: "hit", "data-image-id": hit.image_id, "data-score": hit.score }, img,
        el("figcaption", {}, `#${hit.rank} ${hit.score.toFixed(4)}`, el("br"), el("span", { class: "small" }, hit.image_id)),
        explainButton(hit.image_id, { caption: text })));
    }
    const unknown = result.unknown_words.length ?
      el("p", { class: "note" }, "not in the run's vocabulary (read as <unk>): " + result.unknown_words.join(", ")) : "";
    $("results").replaceChildren(el("h2", {}, `images for «${result.query}»`), unknown, box);
  });
}

function showCaptions(result, src, label, imageId) {
  const list = el("ol", { id: "hits" });
  for (const hit of result.hits) {
    const truth = imageId !== null && hit.image_id === imageId;
    list.append(el("li", { class: "hit" + (truth ? " truth" : ""), "data-caption-index": hit.caption_index,
      "data-score": hit.score }, `${hit.score.toFixed(4)} «${hit.caption}»${truth ? " ✓" : ""} `,
    el("span", { class: "small" }, hit.image_id), " ",
    imageId !== null ? explainButton(imageId, { caption_index: hit.caption_index }) : ""));
  }
  const note = imageId === null ? el("p", { class: "small" }, "attention maps are drawn for gallery images") : "";
  $("results").replaceChildren(el("h2", {}, `captions for ${label}`),
    el("div", { class: "i2t" }, el("figure", { class: "query-image" }, el("img", { src: src, alt: label })),
      el("div", {}, list, note)));
}

function findCaptions(imageId) {
  return run("searching", async () => {
    const result = await call("api/captions?" + new URLSearchParams({ image: imageId, k: count() }));
    showCaptions(result, imageUrl(imageId), `image ${imageId}`, imageId);
  });
}

function uploadImage(file) {
  return run("uploading", async () => {
    const form = new FormData();
    form.append("image", file);
    const result = await call("api/captions?" + new URLSearchParams({ k: count() }), { method: "POST", body: form });
    showCaptions(result, URL.createObjectURL(file), `the uploaded ${file.name}`, null);
  });
}

async function explain(image, params) {
  say("drawing the attention maps…", "busy");
  try {
    const body = await call("api/explain?" + new URLSearchParams({ image: image, ...params }));
    $("attention").innerHTML = "<h2>attention</h2>" + body.html;
    $("attention").scrollIntoView();
    say("");
  } catch (err) { say(err.message, "error"); }
}

$("text-form").addEventListener("submit", (event) => { event.preventDefault(); searchImages($("query").value); });
$("image-form").addEventListener("submit", (event) => { event.preventDefault(); findCaptions($("image-id").value.trim()); });
$("upload").addEventListener("change", () => { if ($("upload").files.length) uploadImage($("upload").files[0]); $("upload").value = ""; });

call("api/info").then((body) => {
  info = body;
  $("run").textContent = `${body.run} — ${body.model}; images: ${body.gallery} (${body.images}); captions: the split's (${body.captions})`;
  $("top").value = body.top;
  $("gallery-ids").replaceChildren(...body.ids.map((id) => el("option", { value: id })));
  $("summary").innerHTML = body.summary_html;
  document.body.dataset.ready = "1";
}, (err) => say(err.message, "error"));
