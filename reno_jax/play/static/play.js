// The play page: plain JS over the JSON API in reno_jax/play/app.py (no libraries, nothing fetched from the web).
// It knows no game: /api/run says which view the environment has and, for a board, its geometry, input kind
// ("cell": click a cell, "column": drop in a column), symbols, colours and sides; for a puzzle, its geometry,
// symbols, colours, moves (labels, keys), move budget and puzzle suites.
"use strict";

const POLL_MS = 3000;      // metrics refresh while the run trains
const RUN_POLL_MS = 10000; // new checkpoints
const SOLVE_STEP_MS = 200; // the pause between the moves of the model's path when it plays to the end
const $ = (id) => document.getElementById(id);

const state = {
  run: null,
  kind: "transcript",  // the run's view: "board", "puzzle" or "transcript"
  view: null,          // the run's board or puzzle view (null: transcripts)
  steps: [],
  board: "",
  moves: 0,            // puzzle: moves made
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
const moveName = (action) => `${state.view.input || "move"} ${state.view.labels[action]}`;

// Board strings are read in either case when the view's characters are all of one case (as the server does).
function normalise(board) {
  const chars = state.view.chars;
  if (chars === chars.toLowerCase()) return board.toLowerCase();
  if (chars === chars.toUpperCase()) return board.toUpperCase();
  return board;
}

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
    if (v.fills) cell.style.background = v.fills[value];
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
  const size = (cellInput ? v.cols : v.num_actions) > 4 ? 52 : 64;
  gridStyle(container, cellInput ? v.rows : 1, cellInput ? v.cols : v.num_actions, size);
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
    const stone = value ? `<span class="stone">${v.symbols[value]}</span>`
      : (v.action_symbols ? `<span class="stone">${v.action_symbols[a]}</span>` : "");
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

function log(text, list = "move-log") {
  const li = document.createElement("li");
  li.textContent = text;
  $(list).appendChild(li);
  $(list).scrollTop = $(list).scrollHeight;
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
  const who = m.side ? `, ${m.side} to move` : "";
  $("thinks-step").textContent = `(step ${m.step}, ${m.greedy ? "greedy" : "sampled"}${who})`;
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

// ------------------------------------------------------------------------------------------------ puzzles

function setPuzzleStatus(text, kind = "") {
  const el = $("puzzle-status");
  el.textContent = text;
  el.className = "status" + (kind ? " " + kind : "");
}

function drawPuzzle() {
  renderBoard($("puzzle-board"), state.board);
  $("puzzle-board").dataset.moves = String(state.moves);
  $("puzzle-counter").textContent = `${state.moves} / ${state.view.max_moves}`;
}

// The person's next step at a position: over, stuck (per the solver, where the environment has one), or a move.
function positionText(out) {
  const left = state.view.max_moves - out.moves;
  if (out.status === "solved") return [`Solved in ${out.moves} moves!`, "over"];
  if (out.status === "out_of_moves") return ["Out of moves. Load the puzzle again or another one.", "over"];
  if (state.view.solver && out.moves_to_solve === null) {
    return ["No longer solvable (per the solver): load the puzzle again.", "error"];
  }
  if (state.view.solver && out.moves_to_solve > left) {
    return [`Not solvable in the ${left} moves left (the solver needs ${out.moves_to_solve}).`, "error"];
  }
  return ["Your move: the arrow keys or the buttons.", ""];
}

function showPosition(out) {
  state.board = out.board;
  state.moves = out.moves;
  state.over = out.status !== "ongoing";
  drawPuzzle();
  $("puzzle-status").dataset.game = out.status;
  $("puzzle-solver").textContent = !state.view.solver || out.status === "solved" ? ""
    : out.moves_to_solve === null ? "(the solver: no longer solvable)"
    : `(the solver: ${out.moves_to_solve} more move${out.moves_to_solve === 1 ? "" : "s"})`;
  const [text, kind] = positionText(out);
  setPuzzleStatus(text, kind);
}

// While a request runs nothing else starts; the model's buttons also wait for a checkpoint.
function setPuzzleBusy(busy) {
  state.busy = busy;
  $("puzzle-load").disabled = busy;
  for (const id of ["puzzle-model-move", "puzzle-model-solve"]) $(id).disabled = busy || !state.steps.length;
}

let puzzleToken = 0;
async function loadPuzzle() {
  if (state.busy || !state.view) return;
  const params = new URLSearchParams({ suite: $("puzzle-suite").value, index: $("puzzle-index").value || "0" });
  const token = ++puzzleToken;  // only the latest request's room is shown (a change event and a click may race)
  try {
    const out = await api(`/api/puzzle?${params}`);
    if (token !== puzzleToken) return;
    $("puzzle-log").innerHTML = "";
    state.lastCells = [];
    showPosition(out);
    $("puzzle-board").dataset.puzzle = `${out.suite}/${out.index}`;
    if ($("sharpen-board").value.length !== out.board.length) {
      $("sharpen-board").value = out.board;
      updateSharpening();
    }
  } catch (e) {
    if (token === puzzleToken) setPuzzleStatus(e.message, "error");
  }
}

async function puzzleMove(action) {
  if (state.busy || !state.board) return;
  if (state.over) { setPuzzleStatus("The puzzle is over. Load it again or another one.", "error"); return; }
  setPuzzleBusy(true);
  try {
    const out = await postJSON("/api/puzzle/move", { board: state.board, action, moves: state.moves });
    state.lastCells = changedCells(out.before, out.board);
    log(`You: ${moveName(action)}` + (out.blocked ? " (blocked)" : ""), "puzzle-log");
    showPosition(out);
  } catch (e) {
    setPuzzleStatus(e.message, "error");
  } finally {
    setPuzzleBusy(false);
  }
}

const modelRequest = () => ({ board: state.board, moves: state.moves, step: selectedStep(),
                              sampled: $("sampled-check").checked });

async function puzzleModelMove() {
  if (state.busy || !state.board) return;
  if (state.over) { setPuzzleStatus("The puzzle is over. Load it again or another one.", "error"); return; }
  setPuzzleBusy(true);
  setPuzzleStatus("The model is thinking...");
  try {
    const out = await postJSON("/api/puzzle/model", modelRequest());
    const m = out.model;
    showThinking(m);
    state.lastCells = changedCells(m.board, out.board);
    log(`Model (step ${m.step}): ${describeChoice(m)}` + (out.blocked ? " (blocked)" : ""), "puzzle-log");
    showPosition(out);
  } catch (e) {
    setPuzzleStatus(e.message, "error");
  } finally {
    setPuzzleBusy(false);
  }
}

// Why the model's play to the end stopped (the server's `ended`), then what the person may do.
function endedText(out) {
  const again = "Load the puzzle again or another one.";
  if (out.ended === "solved") return [`The model solved it: ${out.moves} moves in all.`, "over"];
  if (out.ended === "out_of_moves") return [`The model ran out of moves (${out.moves} / ${state.view.max_moves}). ${again}`, "over"];
  const why = out.ended === "invalid" ? "The model's call was not a move: its episode ended there, as in training."
    : "The run's turn limit (rollout.max_turns) stopped the model.";
  const [text, kind] = positionText(out);
  return [`${why} ${text}`, kind || "error"];
}

async function puzzleSolve() {
  if (state.busy || !state.board) return;
  if (state.over) { setPuzzleStatus("The puzzle is over. Load it again or another one.", "error"); return; }
  setPuzzleBusy(true);
  setPuzzleStatus("The model is playing to the end...");
  $("puzzle-status").dataset.ended = "";
  try {
    const out = await postJSON("/api/puzzle/solve", modelRequest());
    for (const t of out.turns) {  // its path, one move at a time, each with the heat map on the board it faced
      showThinking({ ...t, step: out.step, greedy: out.greedy, side: null, legal: state.view.labels.map(() => true) });
      $("thinks-step").textContent = `(step ${out.step}, ${out.greedy ? "greedy" : "sampled"}, ` +
        `turn ${t.turn + 1} of its play to the end)`;
      state.lastCells = changedCells(state.board, t.board_after);
      state.board = t.board_after;
      state.moves = t.moves;
      drawPuzzle();
      log(`Model (step ${out.step}), turn ${t.turn + 1}: ${describeChoice(t)}` + (t.blocked ? " (blocked)" : ""),
          "puzzle-log");
      await new Promise((resolve) => setTimeout(resolve, SOLVE_STEP_MS));
    }
    showPosition(out);
    const [text, kind] = endedText(out);
    setPuzzleStatus(text, kind);
    $("puzzle-status").dataset.ended = out.ended;
  } catch (e) {
    setPuzzleStatus(e.message, "error");
  } finally {
    setPuzzleBusy(false);
  }
}

function onKey(event) {
  if (state.kind !== "puzzle" || !state.view.keys || event.altKey || event.ctrlKey || event.metaKey) return;
  const tag = event.target && event.target.tagName;
  if (tag === "INPUT" || tag === "SELECT" || tag === "TEXTAREA") return;  // the key is for that control
  const action = state.view.keys.indexOf(event.key);
  if (action < 0) return;
  event.preventDefault();  // no scrolling
  puzzleMove(action);
}

function setUpPuzzle(view) {
  const select = $("puzzle-suite");
  select.innerHTML = "";
  for (const s of view.suites) {
    const o = document.createElement("option");
    o.value = s.name;
    o.textContent = `${s.name} (${s.count})`;
    select.appendChild(o);
  }
  const fitIndex = () => {
    const suite = view.suites.find((s) => s.name === select.value);
    $("puzzle-index").max = String(suite.count - 1);
  };
  select.addEventListener("change", fitIndex);
  fitIndex();
  const row = $("puzzle-moves");
  row.innerHTML = "";
  view.labels.forEach((label, a) => {
    const button = document.createElement("button");
    button.dataset.action = String(a);
    button.textContent = view.action_symbols ? `${view.action_symbols[a]} ${label}` : label;
    if (view.keys) button.title = `key: ${view.keys[a]}`;
    button.addEventListener("click", () => puzzleMove(a));
    row.appendChild(button);
  });
  $("sharpen-board").maxLength = view.rows * view.cols;
  $("sharpen-board").size = Math.min(view.rows * view.cols, 40);
  loadPuzzle();
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

const VIEW_TITLES = {
  board: "play it on its board", puzzle: "play its puzzles", transcript: "its episodes as transcripts" };

function showView(run) {
  state.kind = run.view;
  state.view = run.board || run.puzzle || null;
  $("env-name").textContent = `${run.env}: ${VIEW_TITLES[run.view] || run.view}`;
  for (const el of document.querySelectorAll(".board-only")) el.hidden = run.view !== "board";
  for (const el of document.querySelectorAll(".puzzle-only")) el.hidden = run.view !== "puzzle";
  for (const el of document.querySelectorAll(".model-view")) el.hidden = run.view === "transcript";
  for (const el of document.querySelectorAll(".transcript-only")) el.hidden = run.view !== "transcript";
  if (run.view === "board") setUpBoard(run.board);
  else if (run.view === "puzzle") setUpPuzzle(run.puzzle);
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
    if (state.kind === "puzzle") {  // the person's moves need no checkpoint; the model's buttons wait for one
      if (!state.busy) setPuzzleBusy(false);
      return;
    }
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
  const board = normalise($("sharpen-board").value.trim());
  const size = state.view.rows * state.view.cols;
  $("slider-step").textContent = step === undefined ? "-" : (step === 0 ? "0 (warm start)" : String(step));
  const shown = board.length === size ? board : (state.view.empty || (state.board.length === size ? state.board : ""));
  if (shown) renderBoard($("sharpen-board-view"), shown, { mini: true });
  if (step === undefined || !board) return;
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
  $("puzzle-load").addEventListener("click", loadPuzzle);
  $("puzzle-index").addEventListener("change", loadPuzzle);
  $("puzzle-model-move").addEventListener("click", puzzleModelMove);
  $("puzzle-model-solve").addEventListener("click", puzzleSolve);
  document.addEventListener("keydown", onKey);
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
