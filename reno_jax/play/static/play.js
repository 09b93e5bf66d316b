// The play page: plain JS over the JSON API in reno_jax/play/app.py (no libraries, nothing fetched from the web).
// It knows no game: /api/run says which view the environment has and, for a board, its geometry, input kind
// ("cell": click a cell, "column": drop in a column), symbols, colours and sides.
"use strict";

const POLL_MS = 3000;      // metrics refresh while the run trains
const RUN_POLL_MS = 10000; // new checkpoints
const $ = (id) => document.getElementById(id);

const state = {
  run: null,
  view: null,          // the run's board view (null: transcripts)
  steps: [],
  board: "",
  personSide: 1,
  over: false,
  busy: false,
  lastCells: [],       // cells the model's last move changed
  refusedAction: null,
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

const sideName = (k) => state.view.sides[k - 1];
const moveName = (action) => `${state.view.input} ${state.view.labels[action]}`;

function gridStyle(container, rows, cols, size) {
  container.style.gridTemplateColumns = `repeat(${cols}, ${size}px)`;
  container.style.gridTemplateRows = `repeat(${rows}, ${size}px)`;
}

function renderBoard(container, board, { clickable = false, mini = false } = {}) {
  const v = state.view;
  container.innerHTML = "";
  const size = mini ? (v.cols > 4 ? 24 : 34) : (v.cols > 4 ? 52 : 64);
  gridStyle(container, v.rows, v.cols, size);
  container.dataset.board = board;
  for (let i = 0; i < v.rows * v.cols; i++) {
    const value = Math.max(v.chars.indexOf(board[i]), 0);
    const cell = document.createElement("div");
    cell.className = "cell" + (v.input === "column" ? " slot" : "");
    cell.dataset.index = String(i);
    cell.dataset.value = String(value);
    cell.textContent = v.symbols[value];
    if (value) cell.style.color = v.colors[value];
    const action = v.input === "cell" ? i : i % v.cols;
    if (!mini) {
      if (state.lastCells.includes(i)) cell.classList.add("last");
      if (v.input === "cell" && state.refusedAction === i) cell.classList.add("refused");
    }
    if (clickable) {
      if (v.input === "cell") cell.dataset.action = String(action);
      cell.addEventListener("click", () => personMove(action));
    }
    container.appendChild(cell);
  }
}

function renderDropRow() {
  const v = state.view, row = $("drop-row");
  row.innerHTML = "";
  if (v.input !== "column") return;
  gridStyle(row, 1, v.cols, v.cols > 4 ? 52 : 64);
  row.style.gridTemplateRows = "";
  for (let c = 0; c < v.cols; c++) {
    const button = document.createElement("button");
    button.className = "drop" + (state.refusedAction === c ? " refused" : "");
    button.dataset.action = String(c);
    button.textContent = `\u2193 ${v.labels[c]}`;
    button.title = `drop a piece in column ${v.labels[c]}`;
    button.addEventListener("click", () => personMove(c));
    row.appendChild(button);
  }
}

function renderHeatmap(container, board, result) {
  const v = state.view;
  container.innerHTML = "";
  container.dataset.step = String(result.step);
  if (!result.probs) { container.textContent = result.heat_error || "no heat map"; return; }
  const cellInput = v.input === "cell";
  const size = v.cols > 4 ? 52 : 64;
  gridStyle(container, cellInput ? v.rows : 1, v.cols, size);
  const top = Math.max(...result.probs);
  for (let a = 0; a < v.num_actions; a++) {
    const p = result.probs[a];
    const cell = document.createElement("div");
    cell.className = "heat-cell";
    cell.dataset.prob = String(p);
    cell.dataset.action = String(a);
    // Colour by probability relative to the most likely move, so a flat policy still shows its ranking.
    const alpha = top > 0 ? 0.08 + 0.85 * (p / top) : 0;
    cell.style.background = `rgba(47, 111, 222, ${alpha.toFixed(3)})`;
    if (top > 0 && p / top > 0.55) cell.classList.add("dark");  // white text on the darker cells
    const best = result.best.includes(a);
    if (best) cell.classList.add("optimal");
    if (result.action === a) cell.classList.add("chosen");
    if (!result.legal[a]) cell.classList.add("illegal");
    const value = cellInput ? Math.max(v.chars.indexOf(board[a]), 0) : 0;
    const stone = value ? `<span class="stone">${v.symbols[value]}</span>` : "";
    cell.innerHTML = `<span class="num">${v.labels[a]}</span>${best ? '<span class="star">&#9733;</span>' : ""}` +
      `<b>${(100 * p).toFixed(1)}%</b>${stone}`;
    cell.title = `${moveName(a)}: ${(100 * p).toFixed(2)}% of the move mass` + (best ? " (best)" : "");
    container.appendChild(cell);
  }
}

function describeChoice(result) {
  if (result.verdict === "invalid") {
    return result.parse === "ok" ? "a call the board does not know (invalid)"
                                 : `no valid call (${result.parse.replace("_", " ")})`;
  }
  if (result.verdict === "illegal") return `${moveName(result.action)}: not legal here (illegal)`;
  const best = result.best.length ? (result.best.includes(result.action) ? " (best)" : " (not best)") : "";
  return moveName(result.action) + best;
}

function changedCells(before, after) {
  const out = [];
  for (let i = 0; i < after.length; i++) if (before[i] !== after[i]) out.push(i);
  return out;
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
  renderDropRow();
  renderBoard($("board"), state.board, { clickable: true });
  $("board").dataset.over = String(state.over);
}

function statusText(status) {
  if (status === "draw") return "Draw.";
  if (status === "model_illegal") return "The model chose an illegal move: it is refused and the model loses.";
  if (status === "model_invalid") return "The model made no valid move call: it loses.";
  const winner = status.replace(/_won$/, "");
  return winner === sideName(state.personSide).toLowerCase() ? "You won!" : "The model won.";
}

const yourMove = () => (state.view.input === "column" ? "Your move: drop a piece in a column." : "Your move: click a cell.");

async function sendMove(action) {
  state.busy = true;
  setStatus(action === null ? "The model opens..." : "The model is thinking...");
  try {
    const out = await postJSON("/api/play", { board: state.board, action, step: selectedStep(),
                                              sampled: $("sampled-check").checked });
    if (action !== null) log(`You: ${out.person_label}`);
    state.board = out.board;
    state.lastCells = [];
    state.refusedAction = null;
    if (out.model) {
      const m = out.model;
      showThinking(m);
      if (m.verdict === "legal") state.lastCells = changedCells(out.after_person, m.board_after);
      if (m.verdict === "illegal") state.refusedAction = m.action;
      log(`Model (step ${m.step}): ${describeChoice(m)}`);
    }
    state.over = out.status !== "ongoing";
    drawGame();
    if (state.over) setStatus(statusText(out.status) + " Press New game to play again.", "over");
    else setStatus(yourMove());
    $("status").dataset.game = out.status;
  } catch (e) {
    setStatus(e.message, "error");
  } finally {
    state.busy = false;
  }
}

function personMove(action) {
  if (state.busy) return;
  if (state.over) { setStatus("The game is over. Press New game.", "error"); return; }
  // Illegal moves are refused by the server, whose answer we show.
  sendMove(action);
}

function newGame() {
  if (state.busy || !state.view) return;
  state.personSide = Number($("side-select").value);
  state.board = state.view.empty;
  state.over = false;
  state.lastCells = [];
  state.refusedAction = null;
  $("move-log").innerHTML = "";
  $("status").dataset.game = "ongoing";
  drawGame();
  if (state.personSide !== state.view.first_side) sendMove(null);
  else setStatus(yourMove());
}

function showThinking(m) {
  $("thinks-step").textContent = `(step ${m.step}, ${m.greedy ? "greedy" : "sampled"}, ${m.side} to move)`;
  renderHeatmap($("heatmap"), m.board, m);
  $("heat-mass").textContent = m.mass === null ? "-" : m.mass.toFixed(3);
  $("model-choice").textContent = describeChoice(m);
  $("model-text").textContent = m.text || "(nothing)";
  $("tool-response").textContent = `${m.tool_response}\n(reward ${m.reward})`;
}

function setUpBoard(view) {
  const select = $("side-select");
  select.innerHTML = "";
  view.sides.forEach((name, i) => {
    const o = document.createElement("option");
    o.value = String(i + 1);
    o.textContent = name + (i + 1 === view.first_side ? " (you move first)" : "");
    select.appendChild(o);
  });
  // The model plays the side the run trained it on.
  const person = view.sides.findIndex((_, i) => i + 1 !== view.model_side) + 1;
  select.value = String(person);
  $("sharpen-board").value = view.empty;
  $("sharpen-board").maxLength = view.empty.length;
  newGame();
}

// ------------------------------------------------------------------------------------------------ transcripts

async function playEpisode() {
  const suite = $("suite-select").value;
  const params = new URLSearchParams({ suite, episode: $("episode-input").value || "0",
                                       seed: $("seed-input").value || "0",
                                       sampled: String($("sampled-check").checked) });
  const step = selectedStep();
  if (step !== null) params.set("step", String(step));
  const summary = $("episode-summary");
  summary.textContent = "The model is playing...";
  summary.className = "status";
  $("episode-play").disabled = true;
  try {
    const out = await api(`/api/episode?${params}`);
    const box = $("transcript");
    box.innerHTML = "";
    for (const m of out.messages) {
      const div = document.createElement("div");
      div.className = `msg ${m.role}`;
      const head = document.createElement("div");
      head.className = "who";
      head.textContent = m.role === "assistant" ? `model, turn ${m.turn + 1} (${m.parse.replace("_", " ")})`
        : m.role === "tool" ? `environment (reward ${m.reward}${m.done ? ", done" : ""})` : m.role;
      const body = document.createElement("pre");
      body.className = "raw";
      body.textContent = m.content || "(nothing)";
      div.append(head, body);
      box.appendChild(div);
    }
    const figures = Object.entries(out.info).map(([k, v]) => `${k} ${Number(v.toPrecision(3))}`).join(", ");
    summary.textContent = `step ${out.step}, ${out.greedy ? "greedy" : "sampled"}: ${out.num_turns} turn(s), ` +
      `reward ${out.reward}` + (figures ? ` (${figures})` : "");
    summary.dataset.reward = String(out.reward);
  } catch (e) {
    summary.textContent = e.message;
    summary.className = "status error";
  } finally {
    $("episode-play").disabled = false;
  }
}

function setUpTranscripts(run) {
  const select = $("suite-select");
  select.innerHTML = "";
  for (const s of run.suites) {
    const o = document.createElement("option");
    o.value = s.name;
    o.textContent = s.num_episodes === null ? "the training sampler (seed picks)" : `${s.name} (${s.num_episodes})`;
    select.appendChild(o);
  }
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
  $("run-info").textContent = `${run.workdir}  -  ${run.env}${run.task ? ` (${run.task} task)` : ""}  -  ${ckpts}`;
}

function showView(run) {
  state.view = run.board;
  $("env-name").textContent = `${run.env}: ` + (run.board ? "play it on its board" : "its episodes as transcripts");
  for (const el of document.querySelectorAll(".board-only")) el.hidden = !run.board;
  for (const el of document.querySelectorAll(".transcript-only")) el.hidden = !!run.board;
  if (run.board) setUpBoard(run.board);
  else setUpTranscripts(run);
}

async function pollRun() {
  try {
    const run = await api("/api/run");
    const first = state.run === null;
    state.run = run;
    describeRun(run);
    if (first) showView(run);
    setSteps(run.steps, run.default_step);
    if (!state.view) return;
    if (!run.steps.length) setStatus("No checkpoint yet: the run is still starting. This page updates by itself.", "error");
    else if ($("status").classList.contains("error") && $("status").textContent.startsWith("No checkpoint")) setStatus(yourMove());
  } catch (e) {
    $("run-info").textContent = `cannot reach the server: ${e.message}`;
  }
}

let sharpenToken = 0;
async function updateSharpening() {
  if (!state.view) return;
  const slider = $("ckpt-slider");
  const step = state.steps[Number(slider.value)];
  const board = $("sharpen-board").value.trim().toLowerCase();
  $("slider-step").textContent = step === undefined ? "-" : (step === 0 ? "0 (warm start)" : String(step));
  renderBoard($("sharpen-board-view"), board.length === state.view.empty.length ? board : state.view.empty, { mini: true });
  if (step === undefined) return;
  const token = ++sharpenToken;  // only the answer to the latest slider position is shown
  try {
    const out = await api(`/api/policy?board=${encodeURIComponent(board)}&step=${step}`);
    if (token !== sharpenToken) return;
    renderHeatmap($("sharpen-heatmap"), out.board, out);
    $("sharpen-mass").textContent = out.mass === null ? "-" : out.mass.toFixed(3);
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
  $("episode-play").addEventListener("click", playEpisode);
  $("curve-select").addEventListener("change", (e) => {
    const key = e.target.value;
    if (key && !state.shownCurves.includes(key)) { state.shownCurves.push(key); drawCurves(); }
    e.target.value = "";
  });
  pollRun();
  pollMetrics();
  setInterval(pollMetrics, POLL_MS);
  setInterval(pollRun, RUN_POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
