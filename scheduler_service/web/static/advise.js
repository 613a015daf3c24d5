// The advise view: which dp × cp layout of a GPU count trains sequences like these fastest? The sample is typed
// (lengths) or synthetic:NAME, drawn (seeded) through GET /samplers/{name}; POST /advise prices every layout with
// skrull and with static CP (deepspeed) on the same sampled global batches. Drawn for each ranked layout: tokens/s
// per GPU for both, the spread of its step time over the sampled batches, whether its CP blocks span nodes, and its
// trainer command; then why the first one wins, and the excluded layouts with their reasons. A layout opens its
// plan in the plan view: one global batch drawn from the sample (seeded, below) planned with skrull on it.

import {
  byId, call, clearProblems, fmt, fmtCount, html, inputValue, niceStep, parseLengths, problemLines, showProblem,
  svg, tooltip,
} from "./common.js";

// A problem's "field" (its first name) → the advise form's field (data-field) that shows it. The sampler's query
// (name, num_sequences, seed) is the synthetic draw's; /advise's own seed shares the draw's seed field.
const FIELD_BOXES = {
  sequence_lengths: "sample", histogram: "sample", synthetic: "sample", name: "sample", max_length: "sample",
  num_sequences: "draw", seed: "draw",
  model: "model", profile: "model", gpus: "gpus", gpus_per_node: "gpus_per_node",
  global_batch: "global_batch", tokens_per_step: "global_batch",
};

// The form starts at the example of the advise guide (a 7B model on 32 GPUs); where the catalogue lacks that model,
// at the catalogue's default.
const PREFERRED_MODEL = "qwen2.5-7b";

const CHART = { left: 190, width: 470, gap: 56, spread: 300, row: 36, bar: 12, top: 30, axis: 32 };

const EXCLUSIONS = { no_memory: "no memory", too_long: "too long", no_inter_node_table: "no inter-node table" };

const SYNTHETIC = /^synthetic:(.*)$/is;

const adviseForm = () => byId("advise-form");

// Static CP's throughput on the layout. Both throughputs are the batches' tokens over their summed step times, and
// speedup_vs_static_cp is static CP's summed time over Skrull's, so this is exact.
const staticThroughput = (layout) => layout.tokens_per_s_per_gpu / layout.speedup_vs_static_cp;

const layoutName = (layout) => `dp ${layout.dp_size} × cp ${layout.cp_size}`;

const modes = (layout) => `${layout.sharding} · ckpt ${layout.activation_checkpointing}`;

// How many nodes one CP block spans (only asked of layouts whose blocks do span nodes).
const nodesSpanned = (layout, advice) => Math.ceil(layout.cp_size / advice.gpus_per_node);

// ---- the sample and the request ------------------------------------------------------------------------------

// A problem with the viewer's own syntax (synthetic:NAME), shaped as the service's so that it shows the same way.
class LocalProblem extends Error {
  constructor(field, message) {
    super(message);
    this.problem = { field, errors: [{ field, message }] };
  }
}

// The sample as sent: typed lengths as typed, or synthetic:NAME drawn through the samplers endpoint.
async function resolveSample(samplerNames) {
  const text = byId("sample").value.trim();
  const synthetic = SYNTHETIC.exec(text);
  if (!synthetic) return { lengths: parseLengths(text), source: "typed" };
  const name = synthetic[1].trim();
  if (name === "") throw new LocalProblem("synthetic", `give a sampler's name: ${samplerNames.join(", ")}`);
  const query = new URLSearchParams({ num_sequences: byId("sample-size").value, seed: byId("advise-seed").value });
  const batch = await call("GET", `/samplers/${encodeURIComponent(name)}?${query}`);
  return { lengths: batch.sequence_lengths, source: `synthetic:${batch.sampler}, seed ${batch.seed}` };
}

function adviseRequest(lengths) {
  const request = { sequence_lengths: lengths, model: byId("advise-model").value, gpus: inputValue("gpus") };
  if (byId("advise-profile").value !== "") request.profile = byId("advise-profile").value;
  const optional = [["gpus_per_node", "gpus-per-node"], ["global_batch", "global-batch"], ["seed", "advise-seed"]];
  for (const [field, id] of optional) {
    if (byId(id).value.trim() !== "") request[field] = inputValue(id);
  }
  return request;
}

// mulberry32: a small seeded generator of floats in [0, 1), the same in every browser.
function mulberry32(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// The global batch a layout's plan is opened on: the sample shuffled (Fisher–Yates, mulberry32 seeded with the
// advice's seed), then its first numSequences lengths, cycling when the sample holds fewer. The same sample and
// seed open the same batch; it is not one of the advice's own batches (those are the core's numpy draws).
function globalBatchOf(lengths, numSequences, seed) {
  const random = mulberry32(seed);
  const order = [...lengths];
  for (let i = order.length - 1; i > 0; i -= 1) {
    const j = Math.floor(random() * (i + 1));
    [order[i], order[j]] = [order[j], order[i]];
  }
  return Array.from({ length: numSequences }, (_, i) => order[i % order.length]);
}

// ---- the view ------------------------------------------------------------------------------------------------

export function setUpAdvise({ catalogue, samplers, openPlan }) {
  const samplerNames = samplers.map((sampler) => sampler.name);
  let current = null;  // { advice, sample }: what the drawn results came from, for opening a layout's plan

  byId("advise-model").replaceChildren(...catalogue.models.map((m) => html("option", { value: m.name }, m.name)));
  const names = catalogue.models.map((m) => m.name);
  byId("advise-model").value = names.includes(PREFERRED_MODEL) ? PREFERRED_MODEL : catalogue.default_model;
  byId("advise-profile").replaceChildren(...catalogue.profiles.map((p) => html("option", { value: p.name }, p.name)));
  byId("advise-profile").value = catalogue.default_profile;
  byId("sample-presets").replaceChildren(...samplerNames.map((name) => {
    const button = html("button", { type: "button", class: "link" }, name);
    button.addEventListener("click", () => { byId("sample").value = `synthetic:${name}`; });
    return button;
  }));

  function openLayout(layout) {
    const { advice, sample } = current;
    const numSequences = advice.global_batch.sequences ?? Math.round(advice.mean_sequences_per_batch);
    const nodes = layout.spans_nodes
      ? ` Its CP blocks span ${nodesSpanned(layout, advice)} nodes: blocks larger than a node are priced with the `
        + "profile's inter-node collectives, as the advice prices them."
      : "";
    return openPlan({
      lengths: globalBatchOf(sample.lengths, numSequences, advice.seed),
      dpSize: layout.dp_size,
      cpSize: layout.cp_size,
      bucketSize: layout.bucket_size,
      gpusPerNode: advice.gpus_per_node,
      model: advice.model,
      profile: advice.profile,
      origin: `Layout ${layout.rank} of the advice: ${layoutName(layout)} (${layout.sharding}, activation `
        + `checkpointing ${layout.activation_checkpointing}), bucket size ${layout.bucket_size}. One global batch `
        + `of ${numSequences} sequences drawn from the sample (seeded shuffle, seed ${advice.seed}), planned with `
        + `skrull; the advice's ${fmt(layout.predicted_step_time_ms, 1)} ms is the median over ${advice.num_batches} `
        + `batches, so this one batch's time differs.${nodes}`,
    });
  }

  async function adviseAll(event) {
    event.preventDefault();
    const form = adviseForm();
    clearProblems(form);
    byId("advise").disabled = true;
    byId("advise-status").textContent = "drawing the sample…";
    let answered = null;
    try {
      const sample = await resolveSample(samplerNames);
      byId("advise-status").textContent = `pricing the layouts of ${byId("gpus").value} GPUs…`;
      answered = { advice: await call("POST", "/advise", adviseRequest(sample.lengths)), sample };
    } catch (error) {
      for (const [box, message] of problemLines(error, FIELD_BOXES)) showProblem(form, box, message);
    }
    byId("advise").disabled = false;
    if (answered === null) {
      byId("advice").hidden = true;
      byId("advise-status").textContent = "no advice";
      return;
    }
    current = answered;
    render(answered.advice, answered.sample, openLayout);
    byId("advise-status").textContent = `ranked ${answered.advice.layouts.length} layouts; `
      + `${answered.advice.excluded.length} excluded`;
  }

  // view=advise links fill this form and advise at once, e.g.
  // /?view=advise&sample=synthetic:chatqa2&sample_size=1000&model=qwen2.5-7b&gpus=32&advise=1.
  async function applyLink(query) {
    const fields = { sample: "sample", sample_size: "sample-size", seed: "advise-seed", model: "advise-model",
      profile: "advise-profile", gpus: "gpus", gpus_per_node: "gpus-per-node", global_batch: "global-batch" };
    for (const [name, id] of Object.entries(fields)) {
      if (query.has(name)) byId(id).value = query.get(name);
    }
    if (query.has("advise")) await adviseAll(new Event("submit"));
  }

  adviseForm().addEventListener("submit", adviseAll);
  return { applyLink };
}

// ---- rendering -----------------------------------------------------------------------------------------------

function render(advice, sample, openLayout) {
  byId("advice").hidden = false;
  byId("why").textContent = advice.why;
  const perStep = advice.global_batch.sequences !== undefined
    ? `${fmtCount(advice.global_batch.sequences)} sequences` : `${fmtCount(advice.global_batch.tokens)} tokens`;
  byId("advice-context").textContent = `${advice.model} on ${advice.gpus} GPUs (${advice.gpus_per_node} per node), `
    + `profile ${advice.profile}; ${perStep} per step. Sample: ${fmtCount(advice.sample.num_sequences)} sequences `
    + `(${sample.source}), longest ${fmtCount(advice.sample.longest)} tokens, mean `
    + `${fmtCount(advice.sample.mean_length)}; each layout priced on the same ${advice.num_batches} global `
    + `batches drawn from it (seed ${advice.seed}).`;
  renderLegend();
  byId("advice-chart").replaceChildren(renderChart(advice, openLayout));
  renderLayouts(advice, openLayout);
  renderExcluded(advice);
}

function renderLegend() {
  const items = [
    ["swatch skrull", "Skrull"],
    ["swatch static-cp", "static CP (deepspeed)"],
    ["swatch spread", "step time p10–p90 (dot: median; line: min–max)"],
    ["marker static-step", "static CP's median step time"],
    ["node-mark", "⇄ CP blocks span nodes"],
  ];
  byId("advice-legend").replaceChildren(...items.map(([kind, label]) => {
    const item = html("span", { class: "legend-item" });
    if (kind === "node-mark") item.append(html("span", { class: "node-mark" }, label));
    else item.append(html("span", { class: kind }), document.createTextNode(label));
    return item;
  }));
}

function axis(root, { left, width, y, max, numTicks, label, format }) {
  const step = niceStep(max, numTicks);
  for (let tick = 0; tick <= max + 1e-9; tick += step) {
    const x = left + (tick / max) * width;
    svg("line", { x1: x, x2: x, y1: y, y2: y + 4, class: "tick" }, root);
    svg("text", { x, y: y + 15, class: "tick-label" }, root).textContent = format(tick);
  }
  svg("text", { x: left + width, y: y + 28, class: "axis-label" }, root).textContent = label;
}

function renderChart(advice, openLayout) {
  const { layouts } = advice;
  const spreadLeft = CHART.left + CHART.width + CHART.gap;
  const width = spreadLeft + CHART.spread + 16;
  const height = CHART.top + layouts.length * CHART.row + CHART.axis;
  const root = svg("svg", { class: "advice-chart", width, height, viewBox: `0 0 ${width} ${height}` });
  // the throughput axis leaves room for the value written after each bar
  const maxThroughput = 1.2 * Math.max(...layouts.map((l) => Math.max(l.tokens_per_s_per_gpu, staticThroughput(l))));
  const maxMs = 1.04 * Math.max(...layouts.map((l) => Math.max(l.confidence.step_time_ms_max,
    l.static_cp_step_time_ms)));
  const xRate = (rate) => CHART.left + (rate / maxThroughput) * CHART.width;
  const xMs = (ms) => spreadLeft + (ms / maxMs) * CHART.spread;
  svg("text", { x: CHART.left, y: 12, class: "panel-title" }, root).textContent = "throughput (tokens/s per GPU)";
  svg("text", { x: spreadLeft, y: 12, class: "panel-title" }, root)
    .textContent = `step time over the ${advice.num_batches} sampled batches (ms)`;
  layouts.forEach((layout, index) => {
    const top = CHART.top + index * CHART.row;
    const row = svg("g", { class: "layout-row", "data-rank": layout.rank, role: "button", tabindex: 0 }, root);
    svg("rect", { class: `band band-${index % 2}`, x: 0, y: top, width, height: CHART.row }, row);
    svg("text", { class: "layout-label", x: 4, y: top + 15 }, row)
      .textContent = `${layout.rank}. ${layoutName(layout)}`;
    const second = svg("text", { class: "layout-modes", x: 4, y: top + 29 }, row);
    second.textContent = modes(layout);
    if (layout.spans_nodes) {
      svg("tspan", { class: "node-mark" }, second).textContent = `  ⇄ ${nodesSpanned(layout, advice)} nodes`;
    }
    const skrullTop = top + (CHART.row - 2 * CHART.bar - 2) / 2;
    const staticTop = skrullTop + CHART.bar + 2;
    svg("rect", { class: "bar skrull", x: CHART.left, y: skrullTop, height: CHART.bar,
      width: xRate(layout.tokens_per_s_per_gpu) - CHART.left }, row);
    svg("rect", { class: "bar static-cp", x: CHART.left, y: staticTop, height: CHART.bar,
      width: xRate(staticThroughput(layout)) - CHART.left }, row);
    svg("text", { class: "value skrull-value", x: xRate(layout.tokens_per_s_per_gpu) + 4,
      y: skrullTop + CHART.bar - 2 }, row)
      .textContent = `${fmtCount(layout.tokens_per_s_per_gpu)} (${fmt(layout.speedup_vs_static_cp)}×)`;
    svg("text", { class: "value", x: xRate(staticThroughput(layout)) + 4, y: staticTop + CHART.bar - 2 }, row)
      .textContent = fmtCount(staticThroughput(layout));
    const { confidence } = layout;
    const middle = top + CHART.row / 2;
    svg("line", { class: "range", x1: xMs(confidence.step_time_ms_min), x2: xMs(confidence.step_time_ms_max),
      y1: middle, y2: middle }, row);
    svg("rect", { class: "spread", x: xMs(confidence.step_time_ms_p10), y: middle - 5, height: 10,
      width: Math.max(xMs(confidence.step_time_ms_p90) - xMs(confidence.step_time_ms_p10), 1) }, row);
    svg("circle", { class: "median", cx: xMs(layout.predicted_step_time_ms), cy: middle, r: 3.5 }, row);
    const staticX = xMs(layout.static_cp_step_time_ms);
    svg("path", { class: "static-step", d: `M ${staticX} ${middle - 6} l 5 6 l -5 6 l -5 -6 z` }, row);
    tooltip(row, `${layout.rank}. ${layoutName(layout)}, ${modes(layout)}, bucket ${layout.bucket_size}\n`
      + `Skrull ${fmtCount(layout.tokens_per_s_per_gpu)} tokens/s per GPU, static CP `
      + `${fmtCount(staticThroughput(layout))} (${fmt(layout.speedup_vs_static_cp)}×)\n`
      + `step time: median ${fmt(layout.predicted_step_time_ms, 1)} ms, p10–p90 `
      + `${fmt(confidence.step_time_ms_p10, 1)}–${fmt(confidence.step_time_ms_p90, 1)} ms, min–max `
      + `${fmt(confidence.step_time_ms_min, 1)}–${fmt(confidence.step_time_ms_max, 1)} ms; static CP `
      + `${fmt(layout.static_cp_step_time_ms, 1)} ms\nclick: plan one global batch on this layout`);
    row.addEventListener("click", () => openLayout(layout));
    row.addEventListener("keydown", (event) => {
      if (event.key === "Enter" || event.key === " ") openLayout(layout);
    });
  });
  const axisY = CHART.top + layouts.length * CHART.row + 2;
  axis(root, { left: CHART.left, width: CHART.width, y: axisY, max: maxThroughput, numTicks: 6,
    label: "tokens/s per GPU", format: fmtCount });
  axis(root, { left: spreadLeft, width: CHART.spread, y: axisY, max: maxMs, numTicks: 4, label: "ms",
    format: (ms) => fmtCount(ms) });
  return root;
}

async function copyCommand(code, button) {
  try {
    await navigator.clipboard.writeText(code.textContent);
    button.textContent = "Copied";
  } catch {
    // no clipboard outside a secure context (plain http to another host): select it for the user to copy
    window.getSelection().selectAllChildren(code);
    button.textContent = "Selected: copy it";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 2000);
}

function renderLayouts(advice, openLayout) {
  const columns = [
    ["rank", "#", (l) => String(l.rank)],
    ["layout", "Layout (click: its plan)", null],
    ["bucket", "Bucket (tokens)", (l) => fmtCount(l.bucket_size)],
    ["throughput", "Skrull tokens/s/GPU", (l) => fmtCount(l.tokens_per_s_per_gpu)],
    ["static-throughput", "Static CP tokens/s/GPU", (l) => fmtCount(staticThroughput(l))],
    ["speedup", "Speedup", (l) => `${fmt(l.speedup_vs_static_cp)}×`],
    ["step-time", "Step time, ms", (l) => fmt(l.predicted_step_time_ms, 1)],
    ["spread", "p10–p90, ms", (l) => `${fmtCount(l.confidence.step_time_ms_p10)}–`
      + `${fmtCount(l.confidence.step_time_ms_p90)}`],
    ["headroom", "Memory headroom", (l) => `${fmt(l.memory_headroom_bytes / 2 ** 30, 2)} GiB`],
    ["sharded", "Sequences sharded", (l) => `${fmt(100 * l.sharded_share, 1)} %`],
    ["longest", "Longest trainable (tokens)", (l) => fmtCount(l.longest_trainable_sequence)],
  ];
  const head = html("tr");
  for (const [metric, label] of columns) head.append(html("th", { scope: "col", "data-metric": metric }, label));
  const rows = advice.layouts.flatMap((layout) => {
    const row = html("tr", { class: "layout", "data-rank": String(layout.rank) });
    for (const [metric, , value] of columns) {
      const cell = html("td", { "data-metric": metric });
      if (metric === "layout") {
        const open = html("button", { type: "button", class: "open-plan",
          title: "Plan one global batch of the sample on this layout" }, layoutName(layout));
        open.addEventListener("click", () => openLayout(layout));
        cell.append(open);
        if (layout.spans_nodes) {
          cell.append(html("span", { class: "node-mark", title: `CP blocks of ${layout.cp_size} GPUs span `
            + `${nodesSpanned(layout, advice)} nodes of ${advice.gpus_per_node}: inter-node collectives` },
          `⇄ ${nodesSpanned(layout, advice)} nodes`));
        }
        cell.append(html("div", { class: "modes" }, modes(layout)));
      } else {
        cell.textContent = value(layout);
      }
      row.append(cell);
    }
    row.querySelector('[data-metric="sharded"]').title = layout.sharded_by_degree.length
      ? `by CP degree: ${layout.sharded_by_degree.map((d) => `${d.degree}: ${fmt(100 * d.share, 1)} %`).join(", ")}`
      : "no sequence is sharded";
    row.querySelector('[data-metric="headroom"]').title = `${fmt(100 * layout.memory_headroom_fraction, 1)} % `
      + "of device memory left at the fullest CP rank";
    const commandRow = html("tr", { class: "command", "data-rank": String(layout.rank) });
    const cell = html("td", { colspan: String(columns.length) });
    const code = html("code", { class: "trainer-command" }, layout.trainer_command);
    const copy = html("button", { type: "button", class: "copy" }, "Copy");
    copy.addEventListener("click", () => copyCommand(code, copy));
    cell.append(copy, code);
    commandRow.append(cell);
    return [row, commandRow];
  });
  const table = byId("layouts");
  table.replaceChildren(html("thead"), html("tbody"));
  table.tHead.append(head);
  table.tBodies[0].append(...rows);
}

function renderExcluded(advice) {
  byId("excluded-title").textContent = `Excluded layouts (${advice.excluded.length})`;
  const table = byId("excluded");
  table.hidden = advice.excluded.length === 0;
  const head = html("tr");
  for (const label of ["Layout", "Sharding · checkpointing", "Bucket (tokens)", "Why excluded"]) {
    head.append(html("th", { scope: "col" }, label));
  }
  const rows = advice.excluded.map((excluded) => {
    const row = html("tr", { "data-exclusion": excluded.exclusion });
    const reason = html("td", { "data-metric": "reason" });
    reason.append(html("span", { class: "tag" }, EXCLUSIONS[excluded.exclusion] || excluded.exclusion),
      document.createTextNode(excluded.reason));
    row.append(html("td", {}, layoutName(excluded)), html("td", {}, modes(excluded)),
      html("td", {}, fmtCount(excluded.bucket_size)), reason);
    return row;
  });
  table.replaceChildren(html("thead"), html("tbody"));
  table.tHead.append(head);
  table.tBodies[0].append(...rows);
}
