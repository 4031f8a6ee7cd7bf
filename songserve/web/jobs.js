// songserve page, the jobs: one card per job, the caller's jobs listed again after a reload (GET /jobs),
// each take's live and final players (one plays at a time), phase words a listener reads with the
// engineering figures one click away, "continue from here", a repaint of parts chosen on a take's
// waveform and an extension at its start, whose candidates are heard around their joins and one of them kept. Loaded before app.js, which holds the
// form, the API call helper ($, api, showError, clock) and starts the page; nothing here runs on load.
"use strict";

const TERMINAL = new Set(["completed", "partial", "failed", "cancelled"]);
const ENDED = new Set(["done", "error", "cancelled"]);
const JOBS_PAGE = 20;

// ---- one player at a time ------------------------------------------------------------------------
// Any <audio> that starts pauses every other one (the live players, the final ones, an upload's).
document.addEventListener("play", (event) => {
  document.querySelectorAll("audio").forEach((a) => { if (a !== event.target && !a.paused) a.pause(); });
}, true);

// ---- the caller's jobs, listed again ----------------------------------------------------------------
// GET /jobs answers the jobs this key may see, newest first; a page is appended below those shown.
let olderCursor = null;

async function loadJobs(cursor) {
  const query = new URLSearchParams({ limit: String(JOBS_PAGE) });
  if (cursor) query.set("cursor", cursor);
  try {
    const list = await api(`jobs?${query}`);
    list.jobs.forEach((job) => {
      if (document.querySelector(`.job[data-job-id="${job.job_id}"]`)) return;  // made here since
      const card = makeCard(job.job_id, titleOf(job.asked), false);
      $("jobs").appendChild(card);
      render(card, job);
      if (!jobEnded(job)) follow(card, job.job_id);
    });
    olderCursor = list.next_cursor;
    $("older").hidden = !olderCursor;
  } catch (e) {
    showError($("form-error"), `Your earlier songs could not be listed: ${e.message}`);
  }
  $("jobs").dataset.listed = "1";  // what a test waits for before it counts the cards
}

// A listed job's title, from what it asked: the style, and where a retake or an upload continues from.
function titleOf(asked) {
  const style = asked.tags || asked.prompt || "Untitled";
  const from = asked.continue_from;
  if (!from) return style;
  if (from.parts) return `${style} · repaint ${spansText(from.parts)}`;
  if (from.end_sec) return `${style} · repaint ${clock(from.at_sec)}–${clock(from.end_sec)}`;
  if (from.before_sec) return `${style} · ${from.before_sec} s more at the start`;
  if (from.upload_id) return `${style} · from your audio at ${from.at_sec ? clock(from.at_sec) : "its end"}`;
  return `${style} · from ${clock(from.at_sec)}`;
}

// ---- a job card ------------------------------------------------------------------------------------
// What the server read differently from what was sent (out-of-range values, as the reference reads them).
function adjustedNote(adjusted) {
  const parts = Object.entries(adjusted || {}).map(([field, c]) => `${field} ${JSON.stringify(c.from)} → ${JSON.stringify(c.to)}`);
  return parts.length ? `Adjusted: ${parts.join(", ")}.` : "";
}

function makeCard(jobId, title, live) {
  const card = $("job-tpl").content.firstElementChild.cloneNode(true);
  card.dataset.jobId = jobId;
  card.dataset.live = live ? "1" : "";  // asked to be heard while it is made: play take 1 live
  card.querySelector(".job-title").textContent = `${title} · ${jobId.slice(0, 8)}`;
  card.querySelector(".cancel").addEventListener("click", async () => {
    try { render(card, await api(`job/${jobId}`, { method: "DELETE" })); }
    catch (e) { showError(card.querySelector(".job-error"), e.message); }
  });
  return card;
}

// A job just submitted from this page: its card on top, followed as it runs.
function followJob(jobId, request, adjusted, notes) {
  const card = makeCard(jobId, request.tags || request.prompt || "Untitled", request.live);
  const note = card.querySelector(".job-note");
  note.textContent = [adjustedNote(adjusted), ...(notes || [])].filter(Boolean).join(" ");  // the server's notes
  note.hidden = !note.textContent;
  $("jobs").prepend(card);
  follow(card, jobId);
}

function jobEnded(job) { return TERMINAL.has(job.status) && job.tracks.every((t) => ENDED.has(t.status)); }

// The job's server-sent events (with an API key, its cookie goes along); polling if the stream breaks,
// or when MAX_STREAMS jobs already hold one: a browser keeps six connections to a server, and the
// players' live audio needs some of them too (a reloaded page may follow many running jobs).
const MAX_STREAMS = 3;
let streams = 0;

function follow(card, jobId) {
  const poll = async () => {
    try {
      const job = await api(`job/${jobId}`);
      render(card, job);
      if (!jobEnded(job)) setTimeout(poll, 1000);
    } catch (e) { showError(card.querySelector(".job-error"), e.message); setTimeout(poll, 3000); }
  };
  if (streams >= MAX_STREAMS) { poll(); return; }
  streams += 1;
  let closed = false;
  const source = new EventSource(`job/${jobId}/events`);
  const close = () => { if (!closed) { closed = true; streams -= 1; source.close(); } };
  source.addEventListener("job", (event) => {
    const job = JSON.parse(event.data);
    render(card, job);
    if (jobEnded(job)) close();
  });
  source.onerror = () => {
    if (closed) return;
    close();
    poll();
  };
}

// ---- the words of a phase ------------------------------------------------------------------------------
// What a listener reads; the pipeline's own line (tokens, rates, the worker) is under "details".
function phaseWords(t, job) {
  if (t.status === "queued") return t.queue_position ? `waiting in line · #${t.queue_position}` : "waiting in line";
  if (t.status === "done") return "ready";
  if (t.status === "error") return "failed";
  if (t.status === "cancelled") return "cancelled";
  const words = t.worker_phase.startsWith("loading") ? "warming up the model"
    : { generating: "writing the song", superres: "adding detail", decoding: "rendering audio" }[t.status] || t.status;
  return job.eta_sec ? `${words} · about ${timeLeft(job.eta_sec)} left` : words;
}

function timeLeft(sec) {
  if (sec < 60) return `${Math.max(1, Math.round(sec))} s`;
  const m = Math.floor(sec / 60), s = Math.round(sec - 60 * m);
  return s ? `${m} min ${s} s` : `${m} min`;
}

function figures(t) {
  const parts = [t.phase_display, `${t.progress}%`];
  if (t.waiting) parts.push(`waiting: ${t.waiting}`);
  if (t.worker_id >= 0) parts.push(`worker ${t.worker_id}`);
  if (t.seed !== null && t.seed !== undefined) parts.push(`seed ${t.seed}`);
  if (t.attempts > 1) parts.push(`attempt ${t.attempts}`);
  if (t.status === "done" && t.duration_sec) parts.push(`${t.duration_sec.toFixed(1)} s of audio`);
  return parts.join(" · ");
}

function render(card, job) {
  const eta = job.eta_sec && !TERMINAL.has(job.status) ? ` · about ${timeLeft(job.eta_sec)} left` : "";
  card.querySelector(".job-status").textContent = job.status + eta;
  card.querySelector(".cancel").hidden = TERMINAL.has(job.status);
  const box = card.querySelector(".tracks");
  job.tracks.forEach((t) => {
    let el = box.querySelector(`[data-index="${t.index}"]`);
    if (!el) {
      el = $("track-tpl").content.firstElementChild.cloneNode(true);
      el.dataset.index = t.index;
      el.querySelector(".track-name").textContent = `Take ${t.index + 1}`;
      el.querySelector(".final-audio").setAttribute("aria-label", `Take ${t.index + 1}`);
      el.querySelector(".live-audio").setAttribute("aria-label", `Take ${t.index + 1}, live`);
      box.appendChild(el);
    }
    el.dataset.status = t.status;
    el.querySelector(".phase").textContent = phaseWords(t, job);
    el.querySelector(".figures-text").textContent = figures(t);
    el.querySelector("progress").value = t.progress;
    el.querySelector("progress").hidden = t.status === "done";
    showError(el.querySelector(".track-error"), t.error);
    const handover = renderLive(card, el, t);
    if (t.status === "done" && t.files) showResult(card, el, t, handover);
  });
}

// ---- live audio: a take heard while it is made (GET …/stream, MP3 as it arrives) ----------------------
// "Listen live" (or the form's box, for the first take) plays the stream. When the take is done its
// final player takes the live one's place, at the same second, playing on if it was playing.
function renderLive(card, el, t) {
  const live = el.querySelector(".live");
  const audio = live.querySelector("audio");
  const heard = Boolean(audio.getAttribute("src"));
  if (t.status === "done") {
    if (live.hidden) return null;
    live.hidden = true;
    if (!heard) return null;
    const handover = { at: audio.currentTime, playing: !audio.paused };
    audio.pause();
    audio.removeAttribute("src");  // stop its download
    audio.load();
    return handover;
  }
  if (!t.stream_url || (ENDED.has(t.status) && !heard)) { live.hidden = true; return null; }
  live.hidden = false;
  const listen = live.querySelector(".listen");
  if (ENDED.has(t.status)) {  // failed or cancelled while heard: what was heard stays playable
    live.dataset.final = "";
    live.querySelector(".live-badge").textContent = t.status.toUpperCase();
    live.querySelector(".live-sec").textContent = "";
    listen.hidden = true;
    return null;
  }
  const made = t.preview_sec > 0 ? `${clock(t.preview_sec)} made so far` : "";
  live.querySelector(".live-sec").textContent = heard ? made || "the first seconds are on their way"
    : t.status === "queued" ? "press Listen live to hear it from its first second once it starts"
    : made ? `${made} · press Listen live to hear it` : "press Listen live to hear it as it is made";
  const play = () => {
    if (audio.getAttribute("src")) return;
    audio.src = t.stream_url.replace(/^\//, "");
    audio.play().catch(() => {});  // a browser that wants a click first shows the play button
    listen.hidden = true;
    live.querySelector(".live-sec").textContent = made || "the first seconds are on their way";
  };
  if (!listen.dataset.ready) { listen.dataset.ready = "1"; listen.addEventListener("click", play); }
  if (card.dataset.live === "1" && t.index === 0) play();
  return null;
}

// ---- a finished track: its player, other formats, and "continue from here" ----------------------------
function showResult(card, el, t, handover) {
  const result = el.querySelector(".result");
  const audio = result.querySelector("audio");
  if (!audio.getAttribute("src")) {
    audio.src = t.files.mp3.replace(/^\//, "");
    result.querySelector(".dl-mp3").href = t.files.mp3.replace(/^\//, "");
    result.querySelector(".dl-wav").href = t.files.wav.replace(/^\//, "");
    setupResult(result, card.dataset.jobId, t.index, audio);
    setupRepaint(result, card.dataset.jobId, t.index, audio, t.files.wav.replace(/^\//, ""));
    if (t.metadata && t.metadata.repainted) setupCandidate(card, el, t, audio);
  }
  result.hidden = false;
  if (handover && handover.at > 0) {
    const resume = () => {
      audio.currentTime = handover.at;
      if (handover.playing) audio.play().catch(() => {});
    };
    if (audio.readyState >= 1) resume(); else audio.addEventListener("loadedmetadata", resume, { once: true });
    if (audio.preload === "none") audio.load();
  }
}

// FLAC and Opus are rendered by the server from the stored WAV (GET …/render), at a loudness if chosen.
// A loudness the take cannot reach without clipping is said beside the links: a download link cannot
// read the answer's headers, so the same render is asked for with HEAD (made once, then cached).
async function sayRenderLimit(result, href, loudness) {
  const note = result.querySelector(".render-note");
  showError(note, "");
  try {
    const r = await fetch(href, { method: "HEAD" });
    if (r.ok && r.headers.get("X-Render-Limited") === "true") {
      showError(note, `Reached ${r.headers.get("X-Render-Loudness")} LUFS, not ${loudness}: any louder would clip `
        + "(the take's peaks stop the gain at −1 dBFS).");
    }
  } catch (_) { /* the download itself says what went wrong */ }
}

function renderLinks(result, jobId, index) {
  const loudness = result.querySelector(".loudness").value;
  for (const format of ["flac", "opus"]) {
    const query = new URLSearchParams({ format });
    if (loudness) query.set("loudness", loudness);
    result.querySelector(`.dl-${format}`).href = `job/${jobId}/track/${index}/render?${query}`;
  }
}

// A new job made from a finished take (POST /generate with continue_from): the form's number of takes and
// seed, followed in a card of its own titled after the take's style and ``what``. ``stayOff`` says whether
// the button stays disabled after the answer.
async function submitFrom(card, button, continueFrom, what, stayOff = () => false) {
  const error = card.querySelector(".job-error");
  showError(error, "");
  const body = { continue_from: continueFrom, num_tracks: Number($("num_tracks").value) };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  button.disabled = true;
  try {
    const accepted = await api("generate", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    const title = `${card.querySelector(".job-title").textContent.split(" · ")[0]} · ${what}`;
    followJob(accepted.job_id, { tags: title }, accepted.adjusted);
  } catch (e) {
    showError(error, e.message);
  } finally {
    button.disabled = stayOff();
  }
}

// A retake: the server keeps this track's audio before the player's position and generates the
// rest again (POST /generate with continue_from); style, lyrics and length stay the original's.
function setupResult(result, jobId, index, audio) {
  renderLinks(result, jobId, index);
  result.querySelector(".loudness").addEventListener("change", () => renderLinks(result, jobId, index));
  for (const format of ["flac", "opus"]) {
    const link = result.querySelector(`.dl-${format}`);
    link.addEventListener("click", () => {
      const loudness = result.querySelector(".loudness").value;
      if (loudness) sayRenderLimit(result, link.getAttribute("href"), loudness);
    });
  }
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
    await submitFrom(card, button, { job_id: jobId, track_index: index, at_sec: Number(at.toFixed(3)) },
      `from ${clock(at)}`);
  });
}

// ---- repaint: parts chosen on the take's waveform are written again ------------------------------------
// The waveform is drawn from the take's WAV (Web Audio); a drag over it chooses a part, a drag with Shift
// held adds another (one it overlaps is replaced); their seconds are in the canvas's
// data-part, for tests. "Repaint" asks for them (continue_from with at_sec and end_sec, or parts): num_tracks
// candidates, each the take with only those parts written anew. "Extend the start" asks for a new opening of
// the seconds beside it (continue_from with before_sec), joined into the take's first seconds.
function spansText(spans) {
  return spans.map((s) => `${clock(s.at_sec)}–${clock(s.end_sec)}`).join(", ");
}

function paintTakeWave(canvas, peaks, parts) {
  const g = canvas.getContext("2d"), mid = canvas.height / 2;
  g.clearRect(0, 0, canvas.width, canvas.height);
  peaks.forEach(([lo, hi], x) => {
    const inside = parts.some((part) => x >= part[0] * canvas.width && x <= part[1] * canvas.width);
    g.fillStyle = inside ? "#b91c1c" : "#818cf8";  // the part to write again, then what stays
    g.fillRect(x, mid - hi * mid, 1, Math.max(1, (hi - lo) * mid));
  });
}

async function drawTakeWave(canvas, href) {
  const buffer = await (await fetch(href)).arrayBuffer();
  const ctx = new (window.AudioContext || window.webkitAudioContext)();
  const audio = await ctx.decodeAudioData(buffer);
  canvas.width = canvas.clientWidth || 600;
  const data = audio.getChannelData(0), step = Math.max(1, Math.floor(data.length / canvas.width));
  const peaks = [];
  for (let x = 0; x < canvas.width; x++) {
    let lo = 1, hi = -1;
    for (let i = x * step; i < Math.min(data.length, (x + 1) * step); i++) { lo = Math.min(lo, data[i]); hi = Math.max(hi, data[i]); }
    peaks.push([lo, hi]);
  }
  return { peaks, seconds: audio.duration };
}

function setupRepaint(result, jobId, index, audio, wavHref) {
  const canvas = result.querySelector(".wave"), button = result.querySelector(".repaint");
  const card = result.closest(".job");
  let wave = null, parts = [], drag = null;  // parts: [from, to] as shares of the take, in order
  drawTakeWave(canvas, wavHref).then((w) => { wave = w; paintTakeWave(canvas, w.peaks, []); canvas.dataset.drawn = "1"; })
    .catch(() => { canvas.hidden = true; });  // no waveform: the take still plays
  const at = (event) => {
    const box = canvas.getBoundingClientRect();
    return Math.min(1, Math.max(0, (event.clientX - box.left) / box.width));
  };
  const spans = () => parts.map((part) => {
    const [a, b] = part.map((f) => Number((f * wave.seconds).toFixed(3)));
    return { at_sec: Math.max(a, 0.05), end_sec: b };
  });
  // while dragging: the parts kept and the one being drawn (a click without a drag clears them, with Shift keeps them)
  const chosen = () => (drag ? [...drag.kept, ...(drag.part ? [drag.part] : [])].sort((x, y) => x[0] - y[0]) : parts);
  const show = () => {
    if (!wave) return;
    const now = chosen();
    paintTakeWave(canvas, wave.peaks, now);
    canvas.dataset.part = now.map((part) => part.map((f) => (f * wave.seconds).toFixed(2)).join("-")).join(",");
    button.disabled = now.length === 0;
    const secs = now.map((part) => ({ at_sec: part[0] * wave.seconds, end_sec: part[1] * wave.seconds }));
    button.textContent = now.length ? `Repaint ${spansText(secs)}` : "Repaint a part";
  };
  canvas.addEventListener("pointerdown", (e) => {
    const from = at(e);
    // Shift adds a part to those chosen (those it comes to overlap give way to it); a plain drag starts over.
    // More than the server repaints at once (eight) is its 422, shown under the card.
    const kept = e.shiftKey ? parts.slice() : [];
    drag = { from, kept, part: null };
    canvas.setPointerCapture(e.pointerId);
    show();
  });
  canvas.addEventListener("pointermove", (e) => {
    if (!drag) return;
    const to = at(e), part = [Math.min(drag.from, to), Math.max(drag.from, to)];
    drag.part = part[1] - part[0] > 0.005 ? part : null;
    if (drag.part) drag.kept = drag.kept.filter((k) => k[1] < part[0] || k[0] > part[1]);
    show();
  });
  canvas.addEventListener("pointerup", () => { if (drag) parts = chosen(); drag = null; show(); });
  button.addEventListener("click", async () => {
    if (!parts.length || !wave) return;
    const all = spans();
    const from = all.length === 1 ? { job_id: jobId, track_index: index, ...all[0] }
      : { job_id: jobId, track_index: index, parts: all };
    await submitFrom(card, button, from, `repaint ${spansText(all)}`, () => !parts.length);
  });
  const extend = result.querySelector(".extend"), seconds = result.querySelector(".extend-sec");
  extend.addEventListener("click", async () => {
    const before = Number(seconds.value);
    await submitFrom(card, extend, { job_id: jobId, track_index: index, before_sec: before },
      `${before} s more at the start`);
  });
}

// A repaint's candidate (or an extension's): "Hear" plays a new part from a few seconds before it to a few
// after its join, one button a part; "Keep this one" marks it kept and sets the job's other candidates aside
// (remembered here).
const AROUND_SEC = 3;

function setupCandidate(card, el, t, audio) {
  const r = t.metadata.repainted, fps = 44100 / 2048;
  const row = el.querySelector(".candidate"), hear = row.querySelector(".hear");
  const spans = (r.parts || [r]).map((p) => ({ at_sec: p.start_frame / fps, end_sec: p.join_frame / fps }));
  row.hidden = false;
  row.querySelector(".candidate-part").textContent = `new: ${spansText(spans)}`;
  spans.forEach((span, k) => {
    const button = k === 0 ? hear : hear.parentNode.insertBefore(hear.cloneNode(true), row.querySelector(".keep"));
    if (spans.length > 1) button.textContent = `Hear ${clock(span.at_sec)}–${clock(span.end_sec)}`;
    button.addEventListener("click", () => {
      const start = Math.max(0, span.at_sec - AROUND_SEC);
      const stop = Math.min(audio.duration || Infinity, span.end_sec + AROUND_SEC);
      const until = () => { if (audio.currentTime >= stop) { audio.pause(); audio.removeEventListener("timeupdate", until); } };
      audio.addEventListener("timeupdate", until);
      audio.currentTime = start;
      audio.play().catch(() => {});
      el.dataset.hearing = `${start.toFixed(2)}-${stop.toFixed(2)}`;
    });
  });
  row.querySelector(".keep").addEventListener("click", () => {
    localStorage.setItem(`songserve.kept.${card.dataset.jobId}`, String(t.index));
    markKept(card);
  });
  markKept(card);
}

function markKept(card) {
  const kept = localStorage.getItem(`songserve.kept.${card.dataset.jobId}`);
  card.querySelectorAll(".track").forEach((track) => {
    const mine = kept !== null && track.dataset.index === kept;
    track.classList.toggle("kept", mine);
    track.classList.toggle("set-aside", kept !== null && !mine);
    const keep = track.querySelector(".keep");
    if (keep) keep.textContent = mine ? "Kept" : "Keep this one";
  });
}
