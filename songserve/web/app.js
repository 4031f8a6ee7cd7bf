// songserve page: submit a job, follow it over server-sent events, play and download the tracks.
"use strict";

const $ = (id) => document.getElementById(id);
const TERMINAL = new Set(["completed", "partial", "failed", "cancelled"]);

// With an API key configured on the server, the key is asked for once and kept in this browser.
function apiKey() { return localStorage.getItem("songserve-api-key") || ""; }

async function api(path, options = {}, retried = false) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401 && !retried) {
    const key = window.prompt("This server needs an API key:");
    if (key) { localStorage.setItem("songserve-api-key", key.trim()); return api(path, options, true); }
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

async function loadTags() {
  try {
    const tags = await api("tags");
    for (const category of Object.values(tags)) {
      for (const tag of category.tags.slice(0, 8)) {
        const b = document.createElement("button");
        b.type = "button"; b.textContent = tag; b.title = category.label;
        b.addEventListener("click", () => {
          const parts = $("tags").value.split(",").map((s) => s.trim()).filter(Boolean);
          if (!parts.includes(tag)) parts.push(tag);
          $("tags").value = parts.join(", ");
        });
        $("tag-chips").appendChild(b);
      }
    }
  } catch (_) { /* the chips are a convenience */ }
}

async function refreshStatus() {
  try {
    const s = await api("status");
    $("server-status").textContent = `${s.idle_gpus}/${s.total_gpus} workers idle · ${s.queued_jobs} jobs queued`;
  } catch (e) {
    $("server-status").textContent = `server unreachable: ${e.message}`;
  }
}

$("gen-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  showError($("form-error"), "");
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
  $("generate").disabled = true;
  try {
    const accepted = await api("generate", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    followJob(accepted.job_id, body);
  } catch (e) {
    showError($("form-error"), e.message);
  } finally {
    $("generate").disabled = false;
  }
});

// ---- a job card --------------------------------------------------------------------------------
function followJob(jobId, request) {
  const card = $("job-tpl").content.firstElementChild.cloneNode(true);
  card.dataset.jobId = jobId;
  card.querySelector(".job-title").textContent = (request.tags || request.prompt || "Untitled") + ` · ${jobId.slice(0, 8)}`;
  card.querySelector(".cancel").addEventListener("click", async () => {
    try { render(card, await api(`job/${jobId}`, { method: "DELETE" })); }
    catch (e) { showError(card.querySelector(".job-error"), e.message); }
  });
  $("jobs").prepend(card);

  let closed = false;
  // EventSource cannot send an Authorization header: with an API key, poll instead.
  const source = apiKey() ? { close() {}, addEventListener() {} } : new EventSource(`job/${jobId}/events`);
  if (apiKey()) setTimeout(() => source.onerror(), 0);
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
    if (t.status === "done" && t.files) {
      const result = el.querySelector(".result");
      const audio = result.querySelector("audio");
      if (!audio.getAttribute("src")) {
        audio.src = t.files.mp3.replace(/^\//, "");
        result.querySelector(".dl-mp3").href = t.files.mp3.replace(/^\//, "");
        result.querySelector(".dl-wav").href = t.files.wav.replace(/^\//, "");
      }
      result.hidden = false;
    }
  });
}

loadTags();
refreshStatus();
setInterval(refreshStatus, 5000);
