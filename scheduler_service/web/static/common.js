// What the viewer's two views (the plan view in viewer.js, the advise view in advise.js) share: DOM and SVG
// helpers, the one function that calls the service, and the service's problems shown next to the field each names.

export const byId = (id) => document.getElementById(id);

export function html(tag, attributes = {}, text = undefined) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";

export function svg(tag, attributes = {}, parent = undefined) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (parent) parent.appendChild(node);
  return node;
}

export function tooltip(node, text) {
  svg("title", {}, node).textContent = text;
}

export const fmt = (value, digits = 2) => Number(value).toFixed(digits);

// Whole numbers with thousands separators, as the advice's own sentences write them ("4,469 tokens/s per GPU").
export const fmtCount = (value) => Math.round(value).toLocaleString("en-US");

// The step of an axis with about numTicks ticks: 1, 2 or 5 times a power of ten.
export function niceStep(maxValue, numTicks) {
  const raw = maxValue / numTicks;
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((step) => step >= raw);
}

// ---- the service ---------------------------------------------------------------------------------------------

export class ServiceProblem extends Error {
  constructor(problem) {
    super(`${problem.title}: ${problem.detail}`);
    this.problem = problem;
  }
}

export async function call(method, url, body = undefined) {
  let response;
  try {
    response = await fetch(url, {
      method,
      headers: body === undefined ? {} : { "Content-Type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (error) {
    throw new ServiceProblem({ title: "Service unreachable", detail: String(error.message || error), field: null });
  }
  const text = await response.text();
  let data = null;
  try {
    data = JSON.parse(text);
  } catch {
    data = null;
  }
  if (!response.ok) {
    const problem = data && data.title ? data : { title: `HTTP ${response.status}`, detail: text, field: null };
    throw new ServiceProblem(problem);
  }
  return data;
}

// ---- problems next to fields ---------------------------------------------------------------------------------

// Each form has its boxes (its .field elements, by data-field) and a map from a problem's "field" (its first
// name) to the box that shows it: "sequence_lengths[3]" → boxes.sequence_lengths; what the form does not show
// (or no field) → "request".
function boxFor(field, boxes) {
  const name = String(field || "").replace(/^(query|path)\./, "").split(/[.[]/)[0];
  return boxes[name] || "request";
}

// [box, message] pairs for one failed call: each invalid field's own message beside it when the service lists
// them (422 invalid-request), else the problem's title and detail beside the field it names.
export function problemLines(error, boxes) {
  const { problem } = error;
  if (Array.isArray(problem.errors) && problem.errors.length > 0) {
    return problem.errors.map((item) => [boxFor(item.field, boxes), `${item.field}: ${item.message}`]);
  }
  return [[boxFor(problem.field, boxes), error.message]];
}

export function clearProblems(form) {
  for (const box of form.querySelectorAll(".field")) {
    box.classList.remove("invalid");
    box.querySelector(".problem").textContent = "";
  }
}

export function showProblem(form, boxKey, message) {
  const box = form.querySelector(`.field[data-field="${boxKey}"]`);
  const line = box.querySelector(".problem");
  line.textContent = line.textContent ? `${line.textContent}\n${message}` : message;
  box.classList.add("invalid");
}

// ---- input as typed ------------------------------------------------------------------------------------------

// Numbers go as numbers, anything else as the text typed: the service says what is wrong with which item.
export function parseLengths(text) {
  return text.split(/[\s,;]+/).filter((token) => token !== "").map((token) => {
    const number = Number(token);
    return Number.isFinite(number) && /^[-+0-9.eE]+$/.test(token) ? number : token;
  });
}

export function inputValue(id) {
  const text = byId(id).value.trim();
  const number = Number(text);
  return text !== "" && Number.isFinite(number) ? number : text;
}
