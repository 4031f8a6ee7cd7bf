// songserve page: the form (style, lyrics, length), the fleet's state and what it runs, and starting a
// song from one's own audio; the job cards, their players and the list of one's jobs are in jobs.js.
"use strict";

const $ = (id) => document.getElementById(id);

// With an API key configured on the server, the key is asked for once and kept in this browser.
// <audio>, download links and EventSource cannot send an Authorization header: their reads carry the
// key in a same-site cookie, which the server accepts for GET and HEAD only.
function apiKey() { return localStorage.getItem("songserve-api-key") || ""; }
function keyCookie(key) {
  const folder = location.pathname.replace(/[^/]*$/, "");
  const secure = location.protocol === "https:" ? "; Secure" : "";
  document.cookie = `songserve_key=${encodeURIComponent(key)}; path=${folder}; SameSite=Strict${secure}`;
}
function rememberKey(key) { localStorage.setItem("songserve-api-key", key); keyCookie(key); }
if (apiKey()) keyCookie(apiKey());

// A wrong key is said to be wrong when the key is asked again; a dismissed prompt is not asked again by
// the page's own refreshes (its calls then fail saying the key is missing) until the person submits.
const NEEDS_KEY = "This server needs an API key:";
const WRONG_KEY = "The API key given was not accepted (wrong, or no longer valid). Enter the right key:";
let keyDeclined = false;

async function api(path, options = {}) {
  for (let asked = 0; ; asked++) {
    const headers = { ...(options.headers || {}) };
    const used = apiKey();
    if (used) headers.Authorization = `Bearer ${used}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status === 401 && asked < 3) {
      if (apiKey() !== used) continue;  // given meanwhile, for another call
      if (!keyDeclined) {
        const key = window.prompt(used ? WRONG_KEY : NEEDS_KEY);
        if (key && key.trim()) { rememberKey(key.trim()); continue; }
        keyDeclined = true;
      }
    }
    return answer(response, used);
  }
}

async function answer(response, used) {
  let body = null;
  try { body = await response.json(); } catch (_) { /* not JSON */ }
  if (response.ok) return body;
  let message = (body && body.error) || `The server answered HTTP ${response.status}.`;
  if (response.status === 401) {
    message = used ? "The API key given was not accepted; reload the page to enter the right one."
      : "This server needs an API key and none was given; reload the page to enter it.";
  }
  const error = new Error(message);
  error.status = response.status;  // the server answered: it is reachable
  throw error;
}

function showError(el, message) {
  el.textContent = message || "";
  el.hidden = !message;
}

// ---- the form ----------------------------------------------------------------------------------
function promptMode() { return document.querySelector("input[name=prompt_mode]:checked").value; }

function showMode() {
  const natural = promptMode() === "natural";
  $("tags").hidden = natural; $("tag-chips").hidden = natural; $("prompt").hidden = !natural;
}
function showInstrumental() { $("lyrics-set").hidden = $("instrumental").checked; }
document.querySelectorAll("input[name=prompt_mode]").forEach((r) => r.addEventListener("change", showMode));
$("instrumental").addEventListener("change", showInstrumental);

// The form is kept in this browser (localStorage) as it is typed, so a reload finds it as it was.
const FORM_KEY = "songserve-form";
const KEPT_VALUES = ["tags", "prompt", "lyrics", "duration", "num_tracks", "seed"];
const KEPT_CHECKS = ["instrumental", "live"];

function saveForm() {
  const saved = { prompt_mode: promptMode() };
  KEPT_VALUES.forEach((id) => { saved[id] = $(id).value; });
  KEPT_CHECKS.forEach((id) => { saved[id] = $(id).checked; });
  try { localStorage.setItem(FORM_KEY, JSON.stringify(saved)); } catch (_) { /* storage off or full */ }
}

function restoreForm() {  // true when a kept duration was put back
  let saved = null;
  try { saved = JSON.parse(localStorage.getItem(FORM_KEY) || "null"); } catch (_) { /* not ours */ }
  if (!saved || typeof saved !== "object") return false;
  KEPT_VALUES.forEach((id) => { if (typeof saved[id] === "string") $(id).value = saved[id]; });
  KEPT_CHECKS.forEach((id) => { if (typeof saved[id] === "boolean") $(id).checked = saved[id]; });
  if (["tags", "natural"].includes(saved.prompt_mode)) {
    document.querySelectorAll("input[name=prompt_mode]").forEach((r) => { r.checked = r.value === saved.prompt_mode; });
  }
  showMode(); showInstrumental();
  return typeof saved.duration === "string" && saved.duration !== "";
}

let durationChosen = restoreForm();
$("gen-form").addEventListener("input", saveForm);
$("gen-form").addEventListener("change", saveForm);
$("duration").addEventListener("input", () => { durationChosen = true; });

// The catalogue from /tags (the reference's own tags.json by default), one row of chips per
// group; the reference frontend's default selections are filled in when the field is empty.
const REFERENCE_DEFAULTS = ["Mandopop", "Female Vocals", "Acoustic Guitar", "Piano", "Atmospheric", "Modern Production"];
const CHIPS_SHOWN = 12;

function selectedTags() { return $("tags").value.split(",").map((s) => s.trim()).filter(Boolean); }

function markChips() {
  const chosen = new Set(selectedTags().map((t) => t.toLowerCase()));
  document.querySelectorAll("#tag-chips button.chip").forEach((b) => {
    b.setAttribute("aria-pressed", chosen.has(b.textContent.toLowerCase()) ? "true" : "false");
  });
}

async function loadTags() {
  try {
    const catalogue = await api("tags");
    const all = new Set();
    for (const category of Object.values(catalogue)) {
      const group = document.createElement("div");
      group.className = "tag-group";
      const label = document.createElement("span");
      label.className = "tag-label muted"; label.textContent = category.label;
      group.appendChild(label);
      category.tags.forEach((tag, i) => {
        all.add(tag);
        const b = document.createElement("button");
        b.type = "button"; b.className = "chip"; b.textContent = tag; b.title = category.label;
        b.hidden = i >= CHIPS_SHOWN;
        b.addEventListener("click", () => {
          const parts = selectedTags();
          const at = parts.findIndex((p) => p.toLowerCase() === tag.toLowerCase());
          if (at >= 0) parts.splice(at, 1); else parts.push(tag);
          $("tags").value = parts.join(", ");
          markChips();
          saveForm();
        });
        group.appendChild(b);
      });
      if (category.tags.length > CHIPS_SHOWN) {
        const more = document.createElement("button");
        more.type = "button"; more.className = "more"; more.textContent = `+${category.tags.length - CHIPS_SHOWN} more`;
        more.addEventListener("click", () => {
          group.querySelectorAll("button.chip").forEach((b) => { b.hidden = false; });
          more.remove();
        });
        group.appendChild(more);
      }
      $("tag-chips").appendChild(group);
    }
    if (!$("tags").value.trim()) $("tags").value = REFERENCE_DEFAULTS.filter((t) => all.has(t)).join(", ");
    markChips();
    document.querySelectorAll("#tag-chips button.chip[aria-pressed=true]").forEach((b) => { b.hidden = false; });
  } catch (_) { /* the chips are a convenience */ }
}
$("tags").addEventListener("input", markChips);

// The header: the fleet as GET /status last said, and when it said it (asked every STATUS_EVERY_MS;
// a browser may ask less often in a background tab, and the time shows it). Jobs follow their own events.
const STATUS_EVERY_MS = 5000;

async function refreshStatus() {
  const el = $("server-status");
  const at = new Date().toTimeString().slice(0, 8);
  try {
    const s = await api("status");
    el.textContent = `${s.idle_gpus}/${s.total_gpus} workers idle · ${s.queued_jobs} jobs queued · as of ${at}`;
  } catch (e) {
    el.textContent = e.status ? `${e.message} (as of ${at})` : `server unreachable at ${at}: ${e.message}`;
  }
  el.title = `From GET /status, asked every ${STATUS_EVERY_MS / 1000} s while this page is open.`;
}

// The banner: what the workers run, when it is not music (GET /config's notice: an untrained set).
// Where every worker runs on the CPU, a song's minute takes minutes to make: the length offered first is
// CPU_DURATION, unless the person chose one (this visit, or kept from the last).
const CPU_DURATION = "0.5";
async function refreshConfig() {
  try {
    const config = await api("config");
    $("notice").textContent = config.notice || "";
    $("notice").hidden = !config.notice;
    if (!durationChosen && config.workers > 0 && config.cpu_workers >= config.workers) {
      $("duration").value = CPU_DURATION;
      $("duration").title = "The workers run on the CPU: a short song first (longer ones take minutes).";
      durationChosen = true;
    }
  } catch (_) { /* the header says when the server cannot be reached */ }
  refreshAdapters();
}

// The LoRA adapters the workers can load (GET /adapters): offered in the form only when there are any.
async function refreshAdapters() {
  try {
    const names = (await api("adapters")).adapters.map((a) => a.name);
    const select = $("adapter"), chosen = select.value;
    [...select.options].slice(1).forEach((o) => o.remove());
    names.forEach((n) => select.add(new Option(n, n)));
    select.value = names.includes(chosen) ? chosen : "";
    $("adapter-label").hidden = $("adapter-scale-label").hidden = names.length === 0;
    select.dataset.listed = String(names.length);  // what a test waits for
  } catch (_) { /* without the list the form makes base-model songs */ }
}

function formBody() {
  const instrumental = $("instrumental").checked;
  const body = {
    mode: instrumental ? "instrumental" : "vocal",
    prompt_mode: promptMode(),
    tags: $("tags").value,
    prompt: $("prompt").value,
    lyrics: instrumental ? "" : $("lyrics").value,
    duration: Number($("duration").value),
    num_tracks: Number($("num_tracks").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("adapter").value) {
    body.adapter = $("adapter").value;
    body.adapter_scale = Number($("adapter_scale").value);
  }
  return body;
}

$("gen-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  showError($("form-error"), "");
  const body = formBody();
  keyDeclined = false;  // a person's own click: ask for a key again if the server wants one
  $("generate").disabled = true;
  try {
    const accepted = await api("generate", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    // "Listen live" plays take 1's stream; listening is what makes its live audio (not preview: true,
    // which would make every take's), so only the take heard costs the worker anything.
    followJob(accepted.job_id, { ...body, live: $("live").checked }, accepted.adjusted, accepted.notes);
  } catch (e) {
    showError($("form-error"), e.message);
  } finally {
    $("generate").disabled = false;
  }
});

function clock(sec) {
  const m = Math.floor(sec / 60);
  return `${m}:${(sec - 60 * m).toFixed(1).padStart(4, "0")}`;
}

// ---- one's own audio: upload it (POST /uploads), watch its encoding, continue from a point --------
let upload = null;  // {upload_id, duration_sec, status} while a file is chosen

// The waveform is drawn from the file in this browser (Web Audio); a click on it moves the player, and
// the chosen point (the player's position: where the new part starts) is marked on it.
let wavePeaks = null;  // per pixel column: [lowest, highest] sample of the first channel

function drawWave(buffer) {
  const canvas = $("upload-wave");
  canvas.width = canvas.clientWidth || 600;
  const data = buffer.getChannelData(0);
  const step = Math.max(1, Math.floor(data.length / canvas.width));
  wavePeaks = [];
  for (let x = 0; x < canvas.width; x++) {
    let lo = 1, hi = -1;
    for (let i = x * step; i < Math.min(data.length, (x + 1) * step); i++) { lo = Math.min(lo, data[i]); hi = Math.max(hi, data[i]); }
    wavePeaks.push([lo, hi]);
  }
  paintWave();
  canvas.dataset.drawn = "1";
}

function paintWave() {
  const canvas = $("upload-wave"), a = $("upload-audio");
  if (!wavePeaks) return;
  const g = canvas.getContext("2d"), mid = canvas.height / 2;
  const at = a.duration > 0 && a.currentTime > 0 ? a.currentTime / a.duration : null;
  const split = at === null ? canvas.width : Math.round(at * canvas.width);
  g.clearRect(0, 0, canvas.width, canvas.height);
  wavePeaks.forEach(([lo, hi], x) => {
    g.fillStyle = x < split ? "#818cf8" : "#c7d2fe";  // kept, then what the new part replaces
    g.fillRect(x, mid - hi * mid, 1, Math.max(1, (hi - lo) * mid));
  });
  if (at !== null) {
    g.fillStyle = "#b91c1c";
    g.fillRect(Math.min(split, canvas.width - 2), 0, 2, canvas.height);
  }
  canvas.dataset.marked = at === null ? "" : a.currentTime.toFixed(2);  // what the marker shows, for tests
}

function uploadLabel() {
  const at = $("upload-audio").currentTime;
  $("upload-continue").textContent = at > 0 ? `Continue from ${clock(at)}` : "Continue from the end";
  paintWave();
}

async function watchUpload(id) {
  while (upload && upload.upload_id === id) {
    try {
      const v = await api(`uploads/${id}`);
      upload.status = v.status;
      $("upload-status").textContent = v.status === "failed" ? `failed: ${v.error}` : v.status;
      $("upload-continue").disabled = v.status === "failed";
      if (v.status === "ready" || v.status === "failed") return;
    } catch (e) { showError($("upload-error"), e.message); }
    await new Promise((r) => setTimeout(r, 700));
  }
}

async function chooseFile(file) {
  if (!file) return;
  showError($("upload-error"), "");
  $("upload-box").hidden = false;
  wavePeaks = null;
  $("upload-name").textContent = file.name;
  $("upload-status").textContent = "uploading…";
  $("upload-audio").src = URL.createObjectURL(file);
  try {
    const ctx = new (window.AudioContext || window.webkitAudioContext)();
    file.arrayBuffer().then((b) => ctx.decodeAudioData(b)).then(drawWave).catch(() => {});
  } catch (_) { /* no waveform: the player still works */ }
  const form = new FormData();
  form.append("file", file, file.name);
  try {
    upload = await api("uploads", { method: "POST", body: form });
    $("upload-status").textContent = `${upload.status} · ${upload.duration_sec.toFixed(1)} s`;
    $("upload-continue").disabled = false;
    watchUpload(upload.upload_id);
  } catch (e) {
    upload = null;
    $("upload-status").textContent = "refused";
    showError($("upload-error"), e.message);
  }
}

$("upload-file").addEventListener("change", () => chooseFile($("upload-file").files[0]));
$("drop").addEventListener("dragover", (e) => { e.preventDefault(); $("drop").classList.add("over"); });
$("drop").addEventListener("dragleave", () => $("drop").classList.remove("over"));
$("drop").addEventListener("drop", (e) => {
  e.preventDefault(); $("drop").classList.remove("over");
  chooseFile(e.dataTransfer.files[0]);
});
$("upload-wave").addEventListener("click", (e) => {
  const a = $("upload-audio"), rect = e.target.getBoundingClientRect();
  if (a.duration > 0) a.currentTime = a.duration * (e.clientX - rect.left) / rect.width;
});
$("upload-audio").addEventListener("timeupdate", uploadLabel);
$("upload-audio").addEventListener("seeked", uploadLabel);
$("upload-clear").addEventListener("click", () => {
  upload = null; wavePeaks = null; $("upload-box").hidden = true; $("upload-file").value = "";
  showError($("upload-error"), "");
});
$("upload-continue").addEventListener("click", async () => {
  if (!upload) return;
  showError($("upload-error"), "");
  const at = $("upload-audio").currentTime;
  const body = formBody();
  body.continue_from = { upload_id: upload.upload_id, ...(at > 0 ? { at_sec: Number(at.toFixed(3)) } : {}) };
  $("upload-continue").disabled = true;
  try {
    const accepted = await api("generate", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    const where = at > 0 ? clock(at) : "its end";
    followJob(accepted.job_id, { tags: `${$("upload-name").textContent} · from ${where}` }, accepted.adjusted, accepted.notes);
  } catch (e) {
    showError($("upload-error"), e.message);
  } finally {
    $("upload-continue").disabled = false;
  }
});

$("older").addEventListener("click", () => loadJobs(olderCursor));

// One call after another at first: behind an API key the first one asks for it, the others use it.
(async () => {
  loadTags();
  await refreshStatus();
  await refreshConfig();
  await loadJobs();
  setInterval(() => { refreshStatus(); refreshConfig(); }, STATUS_EVERY_MS);
})();
