// The Skrull plan viewer's page and its plan view. It talks to the public API only: GET /models (models, profiles,
// schedulers), GET /samplers and GET /samplers/{name} (a drawn batch), POST /plan with "breakdown": true (each CP
// rank's estimate per micro-batch, and each world rank's per spanning micro-batch); the advise view (advise.js)
// adds POST /advise. Input is sent as typed, so every complaint shown is the service's own problem+json message,
// placed next to the field it names.

import { setUpAdvise } from "./advise.js";
import {
  byId, call, clearProblems, fmt, html, inputValue, niceStep, parseLengths, problemLines, showProblem, svg, tooltip,
} from "./common.js";

// What a CP rank spends a micro-batch on: the parts of CPRankEstimateModel that add up to its time_ms.
const PARTS = [
  { key: "local", label: "local (whole sequences)", fields: ["local_ms"] },
  { key: "distributed", label: "distributed (whole CP group)", fields: ["distributed_ms"] },
  { key: "sharded", label: "sharded (hybrid group)", fields: ["sharded_ms"] },
  { key: "overhead", label: "fixed, launch-bound floor, padding + exposed communication",
    fields: ["fixed_ms", "launch_bound_ms", "padding_ms", "exposed_comm_ms"] },
];

// A problem's "field" (its first name) → the plan form's field (data-field) that shows it.
const FIELD_BOXES = {
  sequence_lengths: "sequence_lengths", dp_size: "dp_size", cp_size: "cp_size", bucket_size: "bucket_size",
  gpus_per_node: "gpus_per_node",
  model: "model", profile: "model", scheduler: "scheduler", time_limit_s: "scheduler",
  name: "sampler", num_sequences: "sampler", seed: "sampler", max_length: "sampler",
};

const GANTT = { left: 96, width: 840, row: 14, gap: 10, top: 8, axis: 28 };
const MEMORY = { bar: 7, cluster: 8, height: 90, left: 44, top: 10, axis: 30 };

const planForm = () => byId("plan-form");

// ---- the batch -----------------------------------------------------------------------------------------------

function lengthsFromCsv(text) {
  const rows = text.split(/\r?\n/).map((line) => line.split(",").map((cell) => cell.trim()))
    .filter((cells) => cells.some((cell) => cell !== ""));
  if (rows.length === 0) throw new Error("the CSV file is empty");
  let column = 0;
  if (rows[0].every((cell) => !Number.isFinite(Number(cell)))) {  // a header row names the columns
    const named = rows[0].findIndex((cell) => /length|tokens/i.test(cell));
    column = Math.max(named, 0);
    rows.shift();
  }
  return rows.map((cells) => cells[column] ?? "");
}

function applyRequestFile(data) {
  if (Array.isArray(data)) return data;
  if (data && typeof data === "object" && Array.isArray(data.sequence_lengths)) {
    if (data.dp_size !== undefined) byId("dp").value = data.dp_size;
    if (data.cp_size !== undefined) byId("cp").value = data.cp_size;
    if (data.bucket_size !== undefined && data.bucket_size !== null) byId("bucket").value = data.bucket_size;
    if (typeof data.model === "string") byId("model").value = data.model;
    if (typeof data.profile === "string") byId("profile").value = data.profile;
    if (typeof data.scheduler === "string") {
      for (const box of document.querySelectorAll("#schedulers input")) box.checked = box.value === data.scheduler;
    }
    return data.sequence_lengths;
  }
  throw new Error("a JSON file holds a list of lengths or a /plan request with sequence_lengths");
}

async function loadFile() {
  clearProblems(planForm());
  const [file] = byId("file").files;
  if (!file) return;
  try {
    const text = await file.text();
    const isJson = /\.json$/i.test(file.name) || /^\s*[[{]/.test(text);
    let lengths;
    if (isJson) {
      let data;
      try {
        data = JSON.parse(text);
      } catch (error) {
        throw new Error(`${file.name} is not valid JSON: ${error.message}`);
      }
      lengths = applyRequestFile(data);
    } else {
      lengths = lengthsFromCsv(text);
    }
    byId("lengths").value = lengths.join(", ");
  } catch (error) {
    showProblem(planForm(), "file", error.message);
  }
}

async function drawBatch() {
  clearProblems(planForm());
  const name = encodeURIComponent(byId("sampler").value);
  const query = new URLSearchParams({ num_sequences: byId("num-sequences").value, seed: byId("seed").value });
  try {
    const batch = await call("GET", `/samplers/${name}?${query}`);
    byId("lengths").value = batch.sequence_lengths.join(", ");
  } catch (error) {
    showProblem(planForm(), "sampler", error.message);
  }
}

// ---- planning ------------------------------------------------------------------------------------------------

function planRequest(scheduler) {
  const request = {
    sequence_lengths: parseLengths(byId("lengths").value),
    dp_size: inputValue("dp"),
    cp_size: inputValue("cp"),
    model: byId("model").value,
    scheduler,
    breakdown: true,
  };
  if (byId("profile").value !== "") request.profile = byId("profile").value;
  if (byId("bucket").value.trim() !== "") request.bucket_size = inputValue("bucket");
  if (byId("plan-gpus-per-node").value.trim() !== "") request.gpus_per_node = inputValue("plan-gpus-per-node");
  return request;
}

async function planAll(event) {
  event.preventDefault();
  clearProblems(planForm());
  const schedulers = [...document.querySelectorAll("#schedulers input:checked")].map((box) => box.value);
  if (schedulers.length === 0) {
    showProblem(planForm(), "scheduler", "choose at least one scheduler");
    return;
  }
  byId("plan").disabled = true;
  const plans = [];
  const problems = new Map();  // "box\nmessage" → schedulers: a problem of the batch is shown once
  for (const scheduler of schedulers) {
    byId("status").textContent = `planning with ${scheduler}…`;
    try {
      plans.push(await call("POST", "/plan", planRequest(scheduler)));
    } catch (error) {
      for (const [box, message] of problemLines(error, FIELD_BOXES)) {
        const key = `${box}\n${message}`;
        problems.set(key, [...(problems.get(key) || []), scheduler]);
      }
    }
  }
  for (const [key, failed] of problems) {
    const [box, message] = key.split("\n");
    showProblem(planForm(), box, failed.length === schedulers.length ? message : `${failed.join(", ")}: ${message}`);
  }
  byId("status").textContent = `planned ${plans.length} of ${schedulers.length}`;
  byId("plan").disabled = false;
  if (plans.length) render(plans);
  else byId("results").hidden = true;
}

// ---- figures derived from a plan -----------------------------------------------------------------------------

const microBatches = (plan) => plan.dp_ranks.flatMap((dp) => dp.micro_batches);
// The micro-batches over several DP replicas; a plan without any leaves the field out.
const spanningOf = (plan) => plan.spanning ?? [];
const sum = (values) => values.reduce((total, value) => total + value, 0);
const mean = (values) => sum(values) / values.length;
// A field left out is 0 (launch_bound_ms under a profile without a launch-bound floor, padding_ms without buckets).
const partMs = (rank, part) => sum(part.fields.map((field) => rank[field] ?? 0));
const spanName = (span) => `DP ${span.dp_ranks[0]}-${span.dp_ranks[span.dp_ranks.length - 1]}`;

// CP ranks per DP replica: a micro-batch has one local list per CP rank, a spanning one per world rank of its block
// (a replica may run nothing but spanning micro-batches).
function cpSizeOf(plan) {
  const [mb] = microBatches(plan);
  if (mb) return mb.local.length;
  const [span] = spanningOf(plan);
  return span.local.length / span.dp_ranks.length;
}

// Each micro-batch's per-rank estimates, as its ranks run it together: a spanning one's over its block's world
// ranks (where the breakdown has them), then each DP rank's own over its CP ranks.
const rankGroups = (plan) => [
  ...spanningOf(plan).filter((span) => span.ranks).map((span) => span.ranks),
  ...microBatches(plan).map((mb) => mb.cp_ranks),
];

function balances(plan) {
  const dpTimes = plan.dp_ranks.map((dp) => dp.estimated_time_ms);
  const groups = rankGroups(plan);
  const slowest = sum(groups.map((ranks) => Math.max(...ranks.map((rank) => rank.time_ms))));
  const average = sum(groups.map((ranks) => mean(ranks.map((rank) => rank.time_ms))));
  const fullest = Math.max(...groups.flatMap((ranks) => ranks.map((rank) => rank.tokens)));
  return {
    dp: mean(dpTimes) > 0 ? Math.max(...dpTimes) / mean(dpTimes) : 1,
    cp: average > 0 ? slowest / average : 1,
    memory: fullest / plan.bucket_size,
    numMicroBatches: microBatches(plan).length + spanningOf(plan).length,
  };
}

// ---- rendering -----------------------------------------------------------------------------------------------

function render(plans) {
  byId("results").hidden = false;
  renderSummary(plans);
  renderLegend(plans);
  const xMaxMs = Math.max(...plans.map((plan) => plan.estimated_iteration_time_ms));
  byId("gantts").replaceChildren(...plans.map((plan) => renderGantt(plan, xMaxMs)));
  byId("memory").replaceChildren(...plans.map(renderMemory));
}

function renderSummary(plans) {
  const rows = [
    ["iteration", "Estimated iteration (ms)", (p) => fmt(p.estimated_iteration_time_ms)],
    ["bound", "Within the lower bound by", (p) => `${fmt(100 * (p.estimated_iteration_time_ms / p.lower_bound_ms - 1), 1)} %`],
    ["deepspeed", "deepspeed estimate (ms)", (p) => fmt(p.deepspeed_estimated_iteration_time_ms)],
    ["speedup", "Speedup vs deepspeed", (p) => `${fmt(p.speedup_vs_deepspeed)}×`],
    ["dp-balance", "DP balance (max / mean)", (p) => fmt(balances(p).dp, 3)],
    ["cp-balance", "CP balance (max / mean)", (p) => fmt(balances(p).cp, 3)],
    ["memory", "Fullest CP rank / bucket", (p) => `${fmt(100 * balances(p).memory, 1)} %`],
    ["micro-batches", "Micro-batches", (p) => String(balances(p).numMicroBatches)],
    ["bucket", "Bucket size (tokens)", (p) => String(p.bucket_size)],
    ["solve", "Planning time (ms)", (p) => fmt(p.solve_time_ms)],
  ];
  const table = byId("summary");
  const head = html("tr");
  head.append(html("th", {}, `${plans[0].model} · ${plans[0].profile}`));
  for (const plan of plans) head.append(html("th", { scope: "col" }, plan.scheduler));
  const body = rows.map(([metric, label, value]) => {
    const row = html("tr");
    row.append(html("th", { scope: "row" }, label));
    for (const plan of plans) {
      row.append(html("td", { "data-metric": metric, "data-scheduler": plan.scheduler }, value(plan)));
    }
    return row;
  });
  table.replaceChildren(html("thead"), html("tbody"));
  table.tHead.append(head);
  table.tBodies[0].append(...body);
}

function renderLegend(plans) {
  const item = (swatchClass, label) => {
    const entry = html("span", { class: "legend-item" });
    entry.append(html("span", { class: `swatch ${swatchClass}` }), document.createTextNode(label));
    return entry;
  };
  const items = PARTS.map((part) => item(`part-${part.key}`, part.label));
  if (plans.some((plan) => spanningOf(plan).length > 0)) {
    items.push(item("span", "spanning micro-batch (outlined across the DP replicas it spans)"));
  }
  byId("legend").replaceChildren(...items);
}

function timeAxis(root, x, y, xMaxMs, scale) {
  const step = niceStep(xMaxMs, 8);
  for (let tick = 0; tick <= xMaxMs + 1e-9; tick += step) {
    svg("line", { x1: x + tick * scale, x2: x + tick * scale, y1: y, y2: y + 4, class: "tick" }, root);
    svg("text", { x: x + tick * scale, y: y + 15, class: "tick-label" }, root).textContent = fmt(tick, step < 1 ? 1 : 0);
  }
  svg("text", { x: x + GANTT.width, y: y + 26, class: "axis-label" }, root).textContent = "time (ms)";
}

// One micro-batch's per-rank bars from startMs: each rank's time split into PARTS, on the row at rowTop(i) for its
// i-th rank; who(i) names that rank in the tooltip. The bars carry `extra` (which spanning micro-batch they are of).
function drawRankParts(root, { ranks, startMs, totalMs, scale, bucketSize, rowTop, who, extra = {} }) {
  ranks.forEach((rank, i) => {
    let leftMs = startMs;
    for (const part of PARTS) {
      const ms = partMs(rank, part);
      if (ms <= 0) continue;
      const bar = svg("rect", { class: `seg part-${part.key}`, "data-part": part.key, "data-ms": ms, ...extra,
        x: GANTT.left + leftMs * scale, y: rowTop(i) + 1, width: Math.max(ms * scale, 0.5),
        height: GANTT.row - 2 }, root);
      tooltip(bar, `${who(i)}\n${part.label}: ${fmt(ms, 3)} ms\n`
        + `rank total ${fmt(rank.time_ms, 3)} ms of ${fmt(totalMs, 3)} ms; `
        + `${fmt(rank.tokens, 0)} tokens (bucket ${bucketSize}); communication ${fmt(rank.comm_ms, 3)} ms, `
        + `exposed ${fmt(rank.exposed_comm_ms, 3)} ms`);
      leftMs += ms;
    }
  });
}

// Each spanning micro-batch as one outlined block across the rows of the DP replicas it spans, labelled with them,
// from when the last of them is free (their replicas run them first, in plan order: the simulator's
// spanning_ready_s), each world rank's breakdown on its own row. Returns when each replica starts its own.
function drawSpanning(root, plan, { cpSize, scale, rowTop }) {
  const readyMs = plan.dp_ranks.map(() => 0);
  spanningOf(plan).forEach((span, spanIndex) => {
    const [first, last] = [span.dp_ranks[0], span.dp_ranks[span.dp_ranks.length - 1]];
    const startMs = Math.max(...span.dp_ranks.map((dpRank) => readyMs[dpRank]));
    const endMs = startMs + span.estimated_time_ms;
    const [top, bottom] = [rowTop(first, 0), rowTop(last, cpSize)];
    const block = svg("rect", { class: "span", "data-span": spanIndex, "data-dp-ranks": span.dp_ranks.join(","),
      "data-start-ms": startMs, x: GANTT.left + startMs * scale, y: top, width: span.estimated_time_ms * scale,
      height: bottom - top }, root);
    const schemes = schemesOf(span);
    tooltip(block, `spanning micro-batch ${spanIndex} over ${spanName(span)} (world ranks ${first * cpSize}-`
      + `${(last + 1) * cpSize - 1}): from ${fmt(startMs)} ms, ${fmt(span.estimated_time_ms)} ms`
      + (schemes ? `; ${schemes}` : ""));
    const dpOf = (world) => first + Math.floor(world / cpSize);
    drawRankParts(root, { ranks: span.ranks ?? [], startMs, totalMs: span.estimated_time_ms, scale,
      bucketSize: plan.bucket_size, rowTop: (world) => rowTop(dpOf(world), world % cpSize),
      who: (world) => `DP ${dpOf(world)} · CP ${world % cpSize} (world rank ${first * cpSize + world}) · `
        + `spanning micro-batch ${spanIndex} over ${spanName(span)}`,
      extra: { "data-span": spanIndex } });
    svg("line", { class: "mb-end", x1: GANTT.left + endMs * scale, x2: GANTT.left + endMs * scale, y1: top,
      y2: bottom }, root);
    svg("text", { class: "span-label", "data-span": spanIndex, x: GANTT.left + (startMs + endMs) / 2 * scale,
      y: (top + bottom) / 2 + 3.5 }, root).textContent = `spans ${spanName(span)}`;
    for (const dpRank of span.dp_ranks) readyMs[dpRank] = endMs;
  });
  return readyMs;
}

// A micro-batch's collectives that do not all-gather K/V (schema version 3), as its tooltip names them; "" for none.
function schemesOf(mb) {
  const name = (scheme, ulyssesDegree) => (scheme === "2d" ? `2D (Ulysses over ${ulyssesDegree})` : "Ulysses");
  const parts = [];
  if (mb.distributed.length && mb.distributed_scheme) {
    parts.push(`whole group ${name(mb.distributed_scheme, mb.distributed_ulysses_degree)}`);
  }
  for (const group of mb.sharded ?? []) {
    const ranks = group.cp_ranks ?? group.ranks;
    if (group.scheme) parts.push(`ranks ${ranks[0]}-${ranks[ranks.length - 1]} ${name(group.scheme, group.ulysses_degree)}`);
  }
  return parts.join(", ");
}

function renderGantt(plan, xMaxMs) {
  const figure = html("figure", { class: "gantt-figure" });
  figure.append(html("figcaption", {}, `${plan.scheduler}: ${fmt(plan.estimated_iteration_time_ms)} ms per iteration `
    + `(estimated; within ${fmt(100 * (plan.estimated_iteration_time_ms / plan.lower_bound_ms - 1), 1)} % of the `
    + `lower bound), ${fmt(plan.speedup_vs_deepspeed)}× over deepspeed`));
  const cpSize = cpSizeOf(plan);
  const groupHeight = cpSize * GANTT.row + GANTT.gap;
  const height = GANTT.top + plan.dp_ranks.length * groupHeight + GANTT.axis;
  const root = svg("svg", { class: "gantt", "data-scheduler": plan.scheduler, width: GANTT.left + GANTT.width + 20,
    height, viewBox: `0 0 ${GANTT.left + GANTT.width + 20} ${height}` });
  const scale = GANTT.width / xMaxMs;
  const rowTop = (dpRank, cpRank) => GANTT.top + dpRank * groupHeight + cpRank * GANTT.row;
  const ownStartsMs = drawSpanning(root, plan, { cpSize, scale, rowTop });
  plan.dp_ranks.forEach((dp, dpRank) => {
    const top = rowTop(dpRank, 0);
    let startMs = ownStartsMs[dpRank];
    dp.micro_batches.forEach((mb, mbIndex) => {
      const schemes = schemesOf(mb);
      const band = svg("rect", { class: `mb mb-${mbIndex % 2}`, "data-dp": dpRank, "data-mb": mbIndex,
        "data-schemes": schemes, x: GANTT.left + startMs * scale, y: top, width: mb.estimated_time_ms * scale,
        height: cpSize * GANTT.row }, root);
      tooltip(band, `DP ${dpRank}, micro-batch ${mbIndex}: ${fmt(mb.estimated_time_ms)} ms`
        + (schemes ? `; ${schemes}` : ""));
      drawRankParts(root, { ranks: mb.cp_ranks, startMs, totalMs: mb.estimated_time_ms, scale,
        bucketSize: plan.bucket_size, rowTop: (cpRank) => rowTop(dpRank, cpRank),
        who: (cpRank) => `DP ${dpRank} · CP ${cpRank} · micro-batch ${mbIndex}` });
      startMs += mb.estimated_time_ms;
      svg("line", { class: "mb-end", x1: GANTT.left + startMs * scale, x2: GANTT.left + startMs * scale,
        y1: top, y2: top + cpSize * GANTT.row }, root);
    });
    for (let cpRank = 0; cpRank < cpSize; cpRank += 1) {
      svg("text", { class: "row-label", x: GANTT.left - 6, y: top + (cpRank + 0.75) * GANTT.row }, root)
        .textContent = `DP ${dpRank} · CP ${cpRank}`;
    }
  });
  timeAxis(root, GANTT.left, height - GANTT.axis + 2, xMaxMs, scale);
  figure.append(root);
  return figure;
}

function renderMemory(plan) {
  const figure = html("figure", { class: "memory-figure" });
  figure.append(html("figcaption", {}, `${plan.scheduler}: tokens per CP rank, per DP rank and micro-batch`));
  const cpSize = cpSizeOf(plan);
  // One cluster of bars per micro-batch, in the order the ranks run them: the spanning ones (one bar per world rank
  // of the block, where the breakdown has them), then each DP rank's own. `label` goes under a cluster's first bar.
  const clusters = [
    ...spanningOf(plan).map((span, spanIndex) => ({ ranks: span.ranks ?? [], label: spanName(span), span: spanIndex,
      who: (world) => `spanning micro-batch ${spanIndex} over ${spanName(span)} · `
        + `DP ${span.dp_ranks[0] + Math.floor(world / cpSize)} · CP ${world % cpSize}` })),
    ...plan.dp_ranks.flatMap((dp, dpRank) => dp.micro_batches.map((mb, mbIndex) => ({ ranks: mb.cp_ranks,
      label: mbIndex === 0 ? `DP ${dpRank}` : null, who: (cpRank) => `DP ${dpRank} · micro-batch ${mbIndex} · CP ${cpRank}` }))),
  ];
  const lefts = [];
  let width = MEMORY.left;
  for (const { ranks } of clusters) {
    lefts.push(width);
    width += ranks.length * MEMORY.bar + MEMORY.cluster;
  }
  width += 10;
  const height = MEMORY.top + MEMORY.height + MEMORY.axis;
  const fullest = Math.max(1, ...clusters.flatMap(({ ranks }) => ranks.map((rank) => rank.tokens / plan.bucket_size)));
  const yOf = (ratio) => MEMORY.top + MEMORY.height * (1 - ratio / (fullest * 1.05));
  const root = svg("svg", { class: "memory", "data-scheduler": plan.scheduler, width, height,
    viewBox: `0 0 ${width} ${height}` });
  clusters.forEach(({ ranks, label, span, who }, index) => {
    const left = lefts[index];
    ranks.forEach((rank, i) => {
      const ratio = rank.tokens / plan.bucket_size;
      const spanned = span === undefined ? {} : { "data-span": span };
      const bar = svg("rect", { class: `mem${span === undefined ? "" : " span"}${ratio > 1 ? " over" : ""}`,
        "data-tokens": rank.tokens, ...spanned, x: left + i * MEMORY.bar, y: yOf(ratio), width: MEMORY.bar - 1,
        height: yOf(0) - yOf(ratio) }, root);
      tooltip(bar, `${who(i)}: ${fmt(rank.tokens, 0)} tokens, `
        + `${fmt(100 * ratio, 1)} % of the bucket (${plan.bucket_size})`);
    });
    if (label !== null) {
      svg("text", { class: "dp-label", x: left, y: yOf(0) + 14 }, root)
        .textContent = label;
    }
  });
  svg("line", { class: "bucket", x1: MEMORY.left - 4, x2: width - 6, y1: yOf(1), y2: yOf(1) }, root);
  svg("text", { class: "row-label", x: MEMORY.left - 6, y: yOf(1) + 4 }, root).textContent = "bucket";
  svg("text", { class: "row-label", x: MEMORY.left - 6, y: yOf(0) }, root).textContent = "0";
  figure.append(root);
  return figure;
}

// ---- the page: two views over one catalogue -----------------------------------------------------------------

function showView(name) {
  for (const view of ["plan", "advise"]) {
    byId(`${view}-view`).hidden = view !== name;
    byId(`tab-${view}`).setAttribute("aria-selected", String(view === name));
  }
}

// The advise view opens a layout's plan here: the plan form filled as a user would fill it, planned with skrull.
// The note saying where the batch came from stays until the form is edited.
async function openPlan({ lengths, dpSize, cpSize, bucketSize, gpusPerNode, model, profile, origin }) {
  showView("plan");
  byId("lengths").value = lengths.join(", ");
  byId("dp").value = dpSize;
  byId("cp").value = cpSize;
  byId("bucket").value = bucketSize;
  byId("plan-gpus-per-node").value = gpusPerNode;
  byId("model").value = model;
  byId("profile").value = profile;
  for (const box of document.querySelectorAll("#schedulers input")) box.checked = box.value === "skrull";
  byId("plan-origin").textContent = origin;
  byId("plan-origin").hidden = false;
  window.scrollTo(0, 0);
  await planAll(new Event("submit"));
}

async function start() {
  byId("plan-form").addEventListener("submit", planAll);
  byId("plan-form").addEventListener("input", () => { byId("plan-origin").hidden = true; });
  byId("draw").addEventListener("click", drawBatch);
  byId("file").addEventListener("change", loadFile);
  for (const view of ["plan", "advise"]) byId(`tab-${view}`).addEventListener("click", () => showView(view));
  try {
    const [catalogue, samplers] = await Promise.all([call("GET", "/models"), call("GET", "/samplers")]);
    byId("model").replaceChildren(...catalogue.models.map((model) => html("option", { value: model.name }, model.name)));
    byId("model").value = catalogue.default_model;
    byId("profile").replaceChildren(...catalogue.profiles.map((p) => html("option", { value: p.name }, p.name)));
    byId("profile").value = catalogue.default_profile;
    byId("schedulers").replaceChildren(...catalogue.schedulers.map((name) => {
      const label = html("label");
      const box = html("input", { type: "checkbox", value: name, name: "scheduler" });
      box.checked = ["skrull", "deepspeed"].includes(name);
      label.append(box, document.createTextNode(name));
      return label;
    }));
    byId("sampler").replaceChildren(...samplers.samplers.map((s) => html("option", { value: s.name }, s.name)));
    byId("sampler").value = "lmsys";
    const advise = setUpAdvise({ catalogue, samplers: samplers.samplers, openPlan });
    const query = new URLSearchParams(window.location.search);
    if (query.get("view") === "advise") {
      showView("advise");
      await advise.applyLink(query);
    } else {
      await applyLink(query);
    }
  } catch (error) {
    showProblem(planForm(), "request", error.message);
  }
  document.body.dataset.ready = "true";
}

// A link can fill the form and plan at once, e.g.
// /?sampler=longtail64k&num_sequences=64&dp=2&cp=4&schedulers=skrull,deepspeed&plan=1 (or lengths=812,30311,...);
// with view=advise it fills the advise form instead (advise.js).
async function applyLink(query) {
  const fields = { sampler: "sampler", num_sequences: "num-sequences", seed: "seed", lengths: "lengths",
    model: "model", profile: "profile", dp: "dp", cp: "cp", bucket: "bucket" };
  for (const [name, id] of Object.entries(fields)) {
    if (query.has(name)) byId(id).value = query.get(name);
  }
  if (query.has("schedulers")) {
    const chosen = query.get("schedulers").split(",");
    for (const box of document.querySelectorAll("#schedulers input")) box.checked = chosen.includes(box.value);
  }
  if (query.has("sampler") && !query.has("lengths")) await drawBatch();
  if (query.has("plan")) await planAll(new Event("submit"));
}

start();
