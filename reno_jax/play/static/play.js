// The play page: plain JS over the JSON API in reno_jax/play/app.py (no libraries, nothing fetched from the web).
"use strict";

const EMPTY = ".........";
const POLL_MS = 3000;      // metrics refresh while the run trains
const RUN_POLL_MS = 10000; // new checkpoints
const $ = (id) => document.getElementById(id);

const state = {
  run: null,
  steps: [],
  board: EMPTY,
  personSide: "x",
  over: false,
  busy: false,
  lastModelSquare: null,
  refusedSquare: null,
  metricsRows: [],
  metricsKeys: [],
  shownCurves: [],
  curvesInitialised: false,
};

// ------------------------------------------------------------------------------------------------ API

async function api(path, options) {
  const response = await fetch(path, options);
  let body;
  try { body = await response.json(); } catch (e) { body = { error: `HTTP ${response.status}` }; }
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

const postJSON = (path, data) => api(path, {
  method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(data) });

// ------------------------------------------------------------------------------------------------ boards

function renderBoard(container, board, { clickable = false, last = null, refused = null } = {}) {
  container.innerHTML = "";
  for (let i = 0; i < 9; i++) {
    const cell = document.createElement("div");
    const mark = board[i];
    cell.className = "cell" + (mark !== "." ? " " + mark : "");
    if (last === i + 1) cell.classList.add("last");
    if (refused === i + 1) cell.classList.add("refused");
    cell.dataset.square = String(i + 1);
    cell.textContent = mark === "." ? "" : mark.toUpperCase();
    if (clickable) cell.addEventListener("click", () => personMove(i + 1));
    container.appendChild(cell);
  }
}

function renderHeatmap(container, board, result) {
  container.innerHTML = "";
  container.dataset.step = String(result.step);
  const top = Math.max(...result.probs);
  for (let i = 0; i < 9; i++) {
    const p = result.probs[i];
    const cell = document.createElement("div");
    cell.className = "heat-cell";
    cell.dataset.prob = String(p);
    cell.dataset.square = String(i + 1);
    // Colour by probability relative to the most likely square, so a flat policy still shows its ranking.
    const alpha = top > 0 ? 0.08 + 0.85 * (p / top) : 0;
    cell.style.background = `rgba(47, 111, 222, ${alpha.toFixed(3)})`;
    cell.style.color = p / top > 0.55 ? "#fff" : "";
    const optimal = result.optimal.includes(i + 1);
    if (optimal) cell.classList.add("optimal");
    if (result.square === i + 1) cell.classList.add("chosen");
    const stone = board[i] !== "." ? `<span class="stone">${board[i].toUpperCase()}</span>` : "";
    cell.innerHTML = `<span class="num">${i + 1}</span>${optimal ? '<span class="star">&#9733;</span>' : ""}` +
      `<b>${(100 * p).toFixed(1)}%</b>${stone}`;
    cell.title = `square ${i + 1}: ${(100 * p).toFixed(2)}% of the square mass` + (optimal ? " (optimal)" : "");
    container.appendChild(cell);
  }
}

function describeChoice(result) {
  if (result.verdict === "invalid") {
    return result.square === null ? `no valid call (${result.parse.replace("_", " ")})`
                                  : `square ${result.square}: out of range (invalid)`;
  }
  if (result.verdict === "illegal") return `square ${result.square}: taken (illegal)`;
  return `square ${result.square}` + (result.optimal.includes(result.square) ? " (optimal)" : " (not optimal)");
}

// ------------------------------------------------------------------------------------------------ play

function setStatus(text, kind = "") {
  const el = $("status");
  el.textContent = text;
  el.className = "status" + (kind ? " " + kind : "");
}

function log(text) {
  const li = document.createElement("li");
  li.textContent = text;
  $("move-log").appendChild(li);
  $("move-log").scrollTop = $("move-log").scrollHeight;
}

function selectedStep() {
  const v = $("step-select").value;
  return v === "" ? null : Number(v);
}

function drawGame() {
  renderBoard($("board"), state.board, { clickable: true, last: state.lastModelSquare, refused: state.refusedSquare });
  $("board").dataset.over = String(state.over);
}

const STATUS_TEXT = {
  x_won: (me) => (me === "x" ? "You won!" : "The model won."),
  o_won: (me) => (me === "o" ? "You won!" : "The model won."),
  draw: () => "Draw.",
  model_illegal: () => "The model chose a taken square: its move is refused and it loses.",
  model_invalid: () => "The model made no valid choose_square call: it loses.",
};

async function sendMove(square) {
  state.busy = true;
  setStatus(square === null ? "The model opens..." : "The model is thinking...");
  try {
    const out = await postJSON("/api/play", { board: state.board, square, step: selectedStep(),
                                              sampled: $("sampled-check").checked });
    if (square !== null) log(`You: ${square}`);
    state.board = out.board;
    state.lastModelSquare = null;
    state.refusedSquare = null;
    if (out.model) {
      const m = out.model;
      showThinking(m);
      if (m.verdict === "legal") state.lastModelSquare = m.square;
      if (m.verdict === "illegal") state.refusedSquare = m.square;
      log(`Model (step ${m.step}): ${describeChoice(m)}`);
    }
    state.over = out.status !== "ongoing";
    drawGame();
    if (state.over) setStatus(STATUS_TEXT[out.status](state.personSide) + " Press New game to play again.", "over");
    else setStatus("Your move.");
    $("status").dataset.game = out.status;
  } catch (e) {
    setStatus(e.message, "error");
  } finally {
    state.busy = false;
  }
}

function personMove(square) {
  if (state.busy) return;
  if (state.over) { setStatus("The game is over. Press New game.", "error"); return; }
  // Occupied squares are refused by the server, whose answer we show.
  sendMove(square);
}

function newGame() {
  if (state.busy) return;
  state.personSide = $("side-select").value;
  state.board = EMPTY;
  state.over = false;
  state.lastModelSquare = state.refusedSquare = null;
  $("move-log").innerHTML = "";
  $("status").dataset.game = "ongoing";
  drawGame();
  if (state.personSide === "o") sendMove(null);
  else setStatus("Your move: click a square.");
}

function showThinking(m) {
  $("thinks-step").textContent = `(step ${m.step}, ${m.greedy ? "greedy" : "sampled"}, board ${m.board})`;
  renderHeatmap($("heatmap"), m.board, m);
  $("heat-mass").textContent = m.mass.toFixed(3);
  $("model-choice").textContent = describeChoice(m);
  $("model-text").textContent = m.text || "(nothing)";
  $("tool-response").textContent = m.tool_response;
}

// ------------------------------------------------------------------------------------------------ curves

const svgNS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs) {
  const el = document.createElementNS(svgNS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function drawCurve(key) {
  const points = state.metricsRows.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]);
  const box = document.createElement("div");
  box.className = "curve";
  box.dataset.key = key;
  const last = points.length ? points[points.length - 1][1] : null;
  box.innerHTML = `<span class="title">${key}</span><span class="value">${last === null ? "" : last.toPrecision(3)}</span>`;
  const close = document.createElement("button");
  close.className = "close"; close.textContent = "x"; close.title = "remove";
  close.addEventListener("click", () => { state.shownCurves = state.shownCurves.filter((k) => k !== key); drawCurves(); });
  box.appendChild(close);
  const W = 300, H = 110, L = 34, R = 6, T = 6, B = 16;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
    const sx = (x) => L + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - L - R);
    const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    svg.appendChild(svgEl("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fafbfd", stroke: "#e3e6ee" }));
    const label = (x, y, text, anchor) => {
      const t = svgEl("text", { x, y, "font-size": 9, fill: "#6b7385", "text-anchor": anchor });
      t.textContent = text;
      svg.appendChild(t);
    };
    label(L - 3, T + 8, y1.toPrecision(3), "end");
    label(L - 3, H - B, y0.toPrecision(3), "end");
    label(L, H - 4, String(x0), "start");
    label(W - R, H - 4, `step ${x1}`, "end");
    const d = points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    svg.appendChild(svgEl("path", { d, fill: "none", stroke: "#2f6fde", "stroke-width": 1.4,
                                    "vector-effect": "non-scaling-stroke" }));
    if (points.length === 1) svg.appendChild(svgEl("circle", { cx: sx(xs[0]), cy: sy(ys[0]), r: 2.5, fill: "#2f6fde" }));
  } else {
    const t = svgEl("text", { x: W / 2, y: H / 2, "font-size": 11, fill: "#6b7385", "text-anchor": "middle" });
    t.textContent = "no data yet";
    svg.appendChild(t);
  }
  box.appendChild(svg);
  return box;
}

function drawCurves() {
  const container = $("curves");
  container.innerHTML = "";
  if (!state.shownCurves.length) container.textContent = "No metrics yet: the run has not finished a step.";
  for (const key of state.shownCurves) container.appendChild(drawCurve(key));
  container.dataset.rows = String(state.metricsRows.length);
  const select = $("curve-select");
  const current = new Set([...select.options].map((o) => o.value));
  for (const key of state.metricsKeys) {
    if (!current.has(key)) {
      const o = document.createElement("option");
      o.value = key; o.textContent = key;
      select.appendChild(o);
    }
  }
}

async function pollMetrics() {
  try {
    const last = state.metricsRows.length ? state.metricsRows[state.metricsRows.length - 1].step : 0;
    const out = await api(`/api/metrics?since=${last}`);
    if (out.last_step < last) state.metricsRows = [];  // the run was restarted from scratch
    state.metricsRows.push(...out.rows);
    state.metricsKeys = out.keys;
    if (!state.curvesInitialised && out.default_keys.length) {
      state.shownCurves = out.default_keys.slice();
      state.curvesInitialised = true;
    }
    if (out.rows.length || !$("curves").dataset.rows) drawCurves();
  } catch (e) {
    $("curves").dataset.error = e.message;
  }
}

// ------------------------------------------------------------------------------------------------ run, slider

function setSteps(steps, defaultStep) {
  const same = steps.length === state.steps.length && steps.every((s, i) => s === state.steps[i]);
  if (same) return;
  const select = $("step-select");
  const previous = select.value;
  const slider = $("ckpt-slider");
  const sliderStep = state.steps[Number(slider.value)];
  state.steps = steps;
  select.innerHTML = "";
  for (const s of steps) {
    const o = document.createElement("option");
    o.value = String(s);
    o.textContent = s === 0 && state.run.warm_start_step === 0 ? "0 (warm start)" : String(s);
    select.appendChild(o);
  }
  const keep = steps.includes(Number(previous)) && previous !== "" ? previous : String(defaultStep);
  if (steps.length) select.value = keep;
  slider.max = String(Math.max(steps.length - 1, 0));
  slider.disabled = steps.length === 0;
  const idx = steps.indexOf(sliderStep);
  slider.value = String(idx >= 0 ? idx : steps.length - 1);
  updateSharpening();
}

function describeRun(run) {
  const live = run.training;
  const badge = $("live-badge");
  badge.textContent = live ? `training live: step ${run.last_metrics_step} / ${run.num_steps}`
                           : `step ${run.last_metrics_step} / ${run.num_steps}` + (run.last_metrics_step >= run.num_steps ? " (finished)" : "");
  badge.className = "badge" + (live ? " live" : "");
  const ckpts = run.steps.length ? `checkpoints ${run.steps.join(", ")}` : "no checkpoint yet";
  $("run-info").textContent = `${run.workdir}  -  ${run.task} task  -  ${ckpts}`;
}

async function pollRun() {
  try {
    const run = await api("/api/run");
    state.run = run;
    describeRun(run);
    setSteps(run.steps, run.default_step);
    if (!run.steps.length) setStatus("No checkpoint yet: the run is still starting. This page updates by itself.", "error");
    else if ($("status").classList.contains("error") && $("status").textContent.startsWith("No checkpoint")) setStatus("Your move: click a square.");
  } catch (e) {
    $("run-info").textContent = `cannot reach the server: ${e.message}`;
  }
}

let sharpenToken = 0;
async function updateSharpening() {
  const slider = $("ckpt-slider");
  const step = state.steps[Number(slider.value)];
  const board = $("sharpen-board").value.trim().toLowerCase();
  $("slider-step").textContent = step === undefined ? "-" : (step === 0 ? "0 (warm start)" : String(step));
  renderBoard($("sharpen-board-view"), board.length === 9 ? board : EMPTY);
  if (step === undefined) return;
  const token = ++sharpenToken;  // only the answer to the latest slider position is shown
  try {
    const out = await api(`/api/policy?board=${encodeURIComponent(board)}&step=${step}`);
    if (token !== sharpenToken) return;
    renderHeatmap($("sharpen-heatmap"), out.board, out);
    $("sharpen-mass").textContent = out.mass.toFixed(3);
    $("sharpen-choice").textContent = describeChoice(out);
    $("sharpen-error").textContent = "";
  } catch (e) {
    if (token !== sharpenToken) return;
    $("sharpen-heatmap").innerHTML = "";
    $("sharpen-heatmap").dataset.step = "";
    $("sharpen-error").textContent = e.message;
  }
}

// ------------------------------------------------------------------------------------------------ start

function start() {
  $("new-game").addEventListener("click", newGame);
  $("side-select").addEventListener("change", newGame);
  $("ckpt-slider").addEventListener("input", updateSharpening);
  $("sharpen-board").addEventListener("change", updateSharpening);
  $("sharpen-use-game").addEventListener("click", () => {
    $("sharpen-board").value = state.board;
    updateSharpening();
  });
  $("curve-select").addEventListener("change", (e) => {
    const key = e.target.value;
    if (key && !state.shownCurves.includes(key)) { state.shownCurves.push(key); drawCurves(); }
    e.target.value = "";
  });
  drawGame();
  setStatus("Your move: click a square.");
  $("status").dataset.game = "ongoing";
  pollRun();
  pollMetrics();
  setInterval(pollMetrics, POLL_MS);
  setInterval(pollRun, RUN_POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
