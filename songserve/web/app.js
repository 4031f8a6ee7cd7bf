// songserve page: submit a job, follow it over server-sent events, hear each take while it is made,
// play and download the tracks, continue a finished track from the player's position, and start a
// song from one's own audio.
"use strict";

const $ = (id) => document.getElementById(id);
const TERMINAL = new Set(["completed", "partial", "failed", "cancelled"]);

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

async function api(path, options = {}, retried = false) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401 && !retried) {
    const key = window.prompt("This server needs an API key:");
    if (key) { rememberKey(key.trim()); return api(path, options, true); }
  }
  let body = null;
  try { body = await response.json(); } catch (_) { /* not JSON */ }
  if (!response.ok) {
    const message = (body && body.error) || `The server answered HTTP ${response.status}.`;
    throw new Error(message);
  }
  return body;
}

function showError(el, message) {
  el.textContent = message || "";
  el.hidden = !message;
}

// ---- the form ----------------------------------------------------------------------------------
function promptMode() { return document.querySelector("input[name=prompt_mode]:checked").value; }

document.querySelectorAll("input[name=prompt_mode]").forEach((r) => r.addEventListener("change", () => {
  const natural = promptMode() === "natural";
  $("tags").hidden = natural; $("tag-chips").hidden = natural; $("prompt").hidden = !natural;
}));
$("instrumental").addEventListener("change", () => { $("lyrics-set").hidden = $("instrumental").checked; });

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
    el.textContent = `server unreachable at ${at}: ${e.message}`;
  }
  el.title = `From GET /status, asked every ${STATUS_EVERY_MS / 1000} s while this page is open.`;
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
  return body;
}

$("gen-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  showError($("form-error"), "");
  const body = formBody();
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

// ---- a job card --------------------------------------------------------------------------------
// What the server read differently from what was sent (out-of-range values, as the reference reads them).
function adjustedNote(adjusted) {
  const parts = Object.entries(adjusted || {}).map(([field, c]) => `${field} ${JSON.stringify(c.from)} → ${JSON.stringify(c.to)}`);
  return parts.length ? `Adjusted: ${parts.join(", ")}` : "";
}

function followJob(jobId, request, adjusted, notes) {
  const card = $("job-tpl").content.firstElementChild.cloneNode(true);
  card.dataset.jobId = jobId;
  card.dataset.live = request.live ? "1" : "";  // asked to be heard while it is made: play take 1 live
  const note = card.querySelector(".job-note");
  note.textContent = [adjustedNote(adjusted), ...(notes || [])].filter(Boolean).join(" ");  // the server's notes
  note.hidden = !note.textContent;
  card.querySelector(".job-title").textContent = (request.tags || request.prompt || "Untitled") + ` · ${jobId.slice(0, 8)}`;
  card.querySelector(".cancel").addEventListener("click", async () => {
    try { render(card, await api(`job/${jobId}`, { method: "DELETE" })); }
    catch (e) { showError(card.querySelector(".job-error"), e.message); }
  });
  $("jobs").prepend(card);

  let closed = false;
  const source = new EventSource(`job/${jobId}/events`);  // with an API key, its cookie goes along
  source.addEventListener("job", (event) => {
    const job = JSON.parse(event.data);
    render(card, job);
    if (TERMINAL.has(job.status) && job.tracks.every((t) => ["done", "error", "cancelled"].includes(t.status))) {
      closed = true; source.close();
    }
  });
  source.onerror = () => {  // fall back to polling if the stream breaks
    if (closed) return;
    source.close();
    const poll = async () => {
      try {
        const job = await api(`job/${jobId}`);
        render(card, job);
        if (!TERMINAL.has(job.status)) setTimeout(poll, 1000);
      } catch (e) { showError(card.querySelector(".job-error"), e.message); setTimeout(poll, 3000); }
    };
    poll();
  };
}

function render(card, job) {
  const eta = job.eta_sec && !TERMINAL.has(job.status) ? ` · about ${Math.round(job.eta_sec)} s left` : "";
  card.querySelector(".job-status").textContent = job.status + eta;
  card.querySelector(".cancel").hidden = TERMINAL.has(job.status);
  const box = card.querySelector(".tracks");
  job.tracks.forEach((t) => {
    let el = box.querySelector(`[data-index="${t.index}"]`);
    if (!el) {
      el = $("track-tpl").content.firstElementChild.cloneNode(true);
      el.dataset.index = t.index;
      el.querySelector(".track-name").textContent = `Track ${t.index + 1}`;
      box.appendChild(el);
    }
    el.dataset.status = t.status;
    el.querySelector(".phase").textContent = t.phase_display;
    el.querySelector("progress").value = t.progress;
    showError(el.querySelector(".track-error"), t.error);
    renderLive(card, el, t);
    if (t.status === "done" && t.files) {
      const result = el.querySelector(".result");
      const audio = result.querySelector("audio");
      if (!audio.getAttribute("src")) {
        audio.src = t.files.mp3.replace(/^\//, "");
        result.querySelector(".dl-mp3").href = t.files.mp3.replace(/^\//, "");
        result.querySelector(".dl-wav").href = t.files.wav.replace(/^\//, "");
        setupResult(result, card.dataset.jobId, t.index, audio);
      }
      result.hidden = false;
    }
  });
}

// ---- live audio: a take heard while it is made (GET …/stream, MP3 as it arrives) ------------------
// "Listen live" (or the form's box, for the first take) plays the stream; it runs on to the take's end
// and then the final players appear below. The badge says LIVE until the track is done.
function renderLive(card, el, t) {
  const live = el.querySelector(".live");
  const audio = live.querySelector("audio");
  const ended = ["done", "error", "cancelled"].includes(t.status);
  if (!t.stream_url || (ended && !audio.getAttribute("src"))) { live.hidden = true; return; }
  live.hidden = false;
  if (ended) {
    live.dataset.final = "";
    live.querySelector(".live-badge").textContent = t.status === "done" ? "DONE" : t.status.toUpperCase();
    live.querySelector(".live-sec").textContent = "";
    live.querySelector(".listen").hidden = true;
    return;
  }
  live.querySelector(".live-sec").textContent = t.preview_sec > 0 ? `${clock(t.preview_sec)} made so far`
    : t.status === "queued" ? "starts when the track does" : "the first seconds are on their way";
  const listen = live.querySelector(".listen");
  const play = () => {
    if (audio.getAttribute("src")) return;
    audio.src = t.stream_url.replace(/^\//, "");
    audio.play().catch(() => {});  // a browser that wants a click first shows the play button
    listen.hidden = true;
  };
  if (!listen.dataset.ready) { listen.dataset.ready = "1"; listen.addEventListener("click", play); }
  if (card.dataset.live === "1" && t.index === 0) play();
}

// ---- a finished track: other formats, and "continue from here" --------------------------------
// FLAC and Opus are rendered by the server from the stored WAV (GET …/render), at a loudness if chosen.
function renderLinks(result, jobId, index) {
  const loudness = result.querySelector(".loudness").value;
  for (const format of ["flac", "opus"]) {
    const query = new URLSearchParams({ format });
    if (loudness) query.set("loudness", loudness);
    result.querySelector(`.dl-${format}`).href = `job/${jobId}/track/${index}/render?${query}`;
  }
}

function clock(sec) {
  const m = Math.floor(sec / 60);
  return `${m}:${(sec - 60 * m).toFixed(1).padStart(4, "0")}`;
}

// A retake: the server keeps this track's audio before the player's position and generates the
// rest again (POST /generate with continue_from); style, lyrics and length stay the original's.
function setupResult(result, jobId, index, audio) {
  renderLinks(result, jobId, index);
  result.querySelector(".loudness").addEventListener("change", () => renderLinks(result, jobId, index));
  const button = result.querySelector(".continue");
  const label = () => {
    button.textContent = audio.currentTime > 0 ? `Continue from ${clock(audio.currentTime)}` : "Continue from here";
  };
  audio.addEventListener("timeupdate", label);
  audio.addEventListener("seeked", label);
  const card = result.closest(".job");
  button.addEventListener("click", async () => {
    const error = card.querySelector(".job-error");
    const at = audio.currentTime;
    if (!(at > 0)) { showError(error, "Play the track and pause where its new part should start."); return; }
    showError(error, "");
    const body = { continue_from: { job_id: jobId, track_index: index, at_sec: Number(at.toFixed(3)) },
                   num_tracks: Number($("num_tracks").value) };
    if ($("seed").value !== "") body.seed = Number($("seed").value);
    button.disabled = true;
    try {
      const accepted = await api("generate", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      });
      const title = `${card.querySelector(".job-title").textContent.split(" · ")[0]} · from ${clock(at)}`;
      followJob(accepted.job_id, { tags: title }, accepted.adjusted);
    } catch (e) {
      showError(error, e.message);
    } finally {
      button.disabled = false;
    }
  });
}

// ---- one's own audio: upload it (POST /uploads), watch its encoding, continue from a point --------
// The waveform is drawn from the file in this browser (Web Audio); a click on it moves the player.
let upload = null;  // {upload_id, duration_sec, status} while a file is chosen

function drawWave(buffer) {
  const canvas = $("upload-wave");
  canvas.width = canvas.clientWidth || 600;
  const g = canvas.getContext("2d");
  const data = buffer.getChannelData(0);
  const step = Math.max(1, Math.floor(data.length / canvas.width));
  g.clearRect(0, 0, canvas.width, canvas.height);
  g.fillStyle = "#818cf8";
  for (let x = 0; x < canvas.width; x++) {
    let lo = 1, hi = -1;
    for (let i = x * step; i < Math.min(data.length, (x + 1) * step); i++) { lo = Math.min(lo, data[i]); hi = Math.max(hi, data[i]); }
    const mid = canvas.height / 2;
    g.fillRect(x, mid - hi * mid, 1, Math.max(1, (hi - lo) * mid));
  }
  canvas.dataset.drawn = "1";
}

function uploadLabel() {
  const at = $("upload-audio").currentTime;
  $("upload-continue").textContent = at > 0 ? `Continue from ${clock(at)}` : "Continue from the end";
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
  upload = null; $("upload-box").hidden = true; $("upload-file").value = ""; showError($("upload-error"), "");
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

loadTags();
refreshStatus();
setInterval(refreshStatus, STATUS_EVERY_MS);
