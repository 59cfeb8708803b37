// The consumer-proxy console: polls the proxy's JSON API and renders it.
// Every value from the proxy (records, headers, reasons, log lines) is inserted as text
// (textContent, attribute values), never as HTML; the page runs under a strict CSP.
"use strict";

(function () {
  const POLL_MS = 2500;
  const TOKEN_KEY = "cp-console-token";
  const SVG = "http://www.w3.org/2000/svg";
  let timer = null;
  let view = null;          // the current route: {page, group, query}
  let overview = null;      // the last overview (tells whether actions exist)
  let pending = null;       // the confirmation dialog's action

  // -- small DOM helpers (text only) ------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "text") node.textContent = String(value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child !== null && child !== undefined) {
        node.append(typeof child === "string" ? document.createTextNode(child) : child);
      }
    }
    return node;
  }

  function num(value) {
    if (value === null || value === undefined) return "-";
    return typeof value === "number" ? value.toLocaleString("en-US") : String(value);
  }

  function when(epochMs) {
    if (!epochMs) return "-";
    const moment = new Date(epochMs);
    // A forged cp-due-at can be no date at all: said as it is, never a page that stops.
    if (isNaN(moment.getTime())) return String(epochMs) + " ms (not a date)";
    return moment.toISOString().replace(".000Z", "Z");
  }

  function groupHref(page, name) {
    return "#/" + page + "/" + encodeURIComponent(name);
  }

  function setStatus(text) {
    document.getElementById("status").textContent = text;
  }

  // A table whose rows are kept (by key) across polls, so focus and selection survive.
  function table(id, caption, headers) {
    const t = el("table", { id: id });
    t.append(el("caption", { text: caption }));
    const tr = el("tr");
    for (const h of headers) tr.append(el("th", { scope: "col", text: h }));
    t.append(el("thead", {}, tr), el("tbody"));
    return t;
  }

  // cells: strings, or {text, href} for a link, or {text, cls}
  function fill(tableNode, rows) {
    const body = tableNode.tBodies[0];
    const seen = new Set();
    rows.forEach((row, index) => {
      const key = row.key;
      seen.add(key);
      let tr = Array.from(body.rows).find((r) => r.dataset.key === key);
      if (!tr) {
        tr = el("tr");
        tr.dataset.key = key;
      }
      if (body.rows[index] !== tr) body.insertBefore(tr, body.rows[index] || null);
      row.cells.forEach((cell, i) => {
        const spec = typeof cell === "object" && cell !== null ? cell : { text: cell };
        let td = tr.cells[i];
        if (!td) {
          td = el(i === 0 ? "th" : "td", i === 0 ? { scope: "row" } : {});
          tr.append(td);
        }
        if (spec.href) {
          let a = td.firstElementChild;
          if (!a || a.tagName !== "A") {
            td.textContent = "";
            a = el("a");
            td.append(a);
          }
          if (a.getAttribute("href") !== spec.href) a.setAttribute("href", spec.href);
          if (a.textContent !== String(spec.text)) a.textContent = String(spec.text);
        } else if (td.textContent !== String(spec.text) || td.firstElementChild) {
          td.textContent = String(spec.text);
        }
        td.className = spec.cls || "";
      });
    });
    for (const tr of Array.from(body.rows)) if (!seen.has(tr.dataset.key)) tr.remove();
  }

  // -- the API ----------------------------------------------------------------------------

  async function getJson(path) {
    const answer = await fetch(path, { cache: "no-store" });
    return answer.json();
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  async function post(path) {
    return fetch(path, {
      method: "POST",
      headers: { Authorization: "Bearer " + (token() || "") },
      cache: "no-store",
    });
  }

  // -- routing ----------------------------------------------------------------------------

  function route() {
    const hash = location.hash || "#/";
    const [path, query] = hash.slice(1).split("?");
    const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
    if (parts[0] === "group" && parts[1]) return { page: "group", group: parts[1], query: "" };
    if (parts[0] === "dlq" && parts[1]) return { page: "dlq", group: parts[1], query: query || "" };
    return { page: "overview", group: null, query: "" };
  }

  function navigate() {
    view = route();
    const main = document.getElementById("main");
    main.textContent = "";
    const nav = document.getElementById("nav");
    nav.textContent = "";
    nav.append(el("a", { href: "#/", text: "Overview", "aria-current": view.page === "overview" ? "page" : null }));
    if (view.group) {
      nav.append(el("a", { href: groupHref("group", view.group), text: "Group " + view.group,
        "aria-current": view.page === "group" ? "page" : null }));
      nav.append(el("a", { href: groupHref("dlq", view.group), text: "Dead letters",
        "aria-current": view.page === "dlq" ? "page" : null }));
    }
    if (view.page === "overview") buildOverview(main);
    else if (view.page === "group") buildGroup(main);
    else buildDlq(main);
    refresh();
  }

  function refresh() {
    clearTimeout(timer);
    const current = view;
    const work = view.page === "overview" ? pollOverview()
      : view.page === "group" ? pollGroup() : pollDlq();
    work.catch((error) => setStatus("Cannot reach the proxy: " + error))
      .finally(() => { if (view === current) timer = setTimeout(refresh, POLL_MS); });
  }

  // -- sign-in ----------------------------------------------------------------------------

  function showSignin() {
    const admin = overview && overview.admin;
    const signedIn = admin && token();
    document.getElementById("signin").hidden = !admin || !!signedIn;
    document.getElementById("who").hidden = !signedIn;
  }

  async function signIn(event) {
    event.preventDefault();
    const input = document.getElementById("token");
    sessionStorage.setItem(TOKEN_KEY, input.value);
    const answer = await post("/admin/console/check");
    input.value = "";
    if (answer.ok) {
      setStatus("Signed in: DLQ actions are on.");
    } else {
      sessionStorage.removeItem(TOKEN_KEY);
      setStatus("Sign-in refused (" + answer.status + "): wrong token.");
    }
    showSignin();
    navigate();
  }

  function signOut() {
    sessionStorage.removeItem(TOKEN_KEY);
    setStatus("Signed out.");
    showSignin();
    navigate();
  }

  // -- overview ---------------------------------------------------------------------------

  function buildOverview(main) {
    main.append(el("h1", { text: "Groups" }));
    main.append(el("p", { id: "kafka-error", class: "warn", hidden: true }));
    main.append(table("groups", "Every group of this proxy, updated every few seconds",
      ["Group", "State", "Msg/s", "Lag", "In flight", "Paused", "DLQ depth", "Retry tiers"]));
  }

  async function pollOverview() {
    overview = await getJson("/console/api/overview");
    showSignin();
    if (view.page !== "overview") return;
    const warn = document.getElementById("kafka-error");
    warn.hidden = !overview.kafka_error;
    warn.textContent = overview.kafka_error ? "Kafka: " + overview.kafka_error : "";
    fill(document.getElementById("groups"), overview.groups.map((g) => ({
      key: g.name,
      cells: [
        { text: g.name, href: groupHref("group", g.name) },
        { text: g.state, cls: "state " + stateClass(g.state) },
        num(g.msg_per_s),
        num(g.lag),
        num(g.in_flight),
        pausedText(g),
        { text: g.dlq_depth === null ? "no DLQ yet" : num(g.dlq_depth), href: groupHref("dlq", g.name) },
        g.tiers.length ? g.tiers.map((t) => "tier " + t.tier + ": " + num(t.depth)).join(", ") : "none",
      ],
    })));
  }

  function stateClass(state) {
    if (state === "running") return "ok";
    if (state === "starting") return "info";
    return "bad";
  }

  function pausedText(g) {
    if (!g.paused) return "0 of " + g.partitions;
    const reasons = Object.entries(g.pause_reasons).map(([r, n]) => r + " " + n).join(", ");
    return g.paused + " of " + g.partitions + " (" + reasons + ")";
  }

  // -- a group ----------------------------------------------------------------------------

  function buildGroup(main) {
    main.append(el("h1", { text: "Group " + view.group }));
    main.append(el("p", { id: "group-state", class: "state" }));
    main.append(el("p", { id: "group-detail", class: "detail" }));
    main.append(el("p", {}, el("a", { href: groupHref("dlq", view.group), text: "Dead letters of " + view.group })));
    main.append(table("partitions", "Partitions owned by this proxy",
      ["Partition", "Committed", "End", "Lag", "In flight / window", "Oldest call", "Paused", "Ack state"]));
    main.append(table("instances", "Service instances",
      ["Instance", "In rotation", "Health", "In flight", "Calls", "Latency"]));
    const figure = el("figure", { class: "chart" });
    figure.append(el("figcaption", { id: "chart-caption", text: "Breaker and concurrency limit, last 15 minutes" }));
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("id", "chart");
    svg.setAttribute("viewBox", "0 0 600 120");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-labelledby", "chart-caption");
    figure.append(svg);
    main.append(figure);
    main.append(table("tiers", "Retry tiers", ["Tier", "Topic", "Delay", "Depth", "Next due"]));
    main.append(el("h2", { text: "Recent state changes" }));
    main.append(el("ol", { id: "lines", class: "lines" }));
  }

  async function pollGroup() {
    const name = view.group;
    const g = await getJson("/console/api/groups/" + encodeURIComponent(name));
    if (view.page !== "group" || view.group !== name) return;
    if (g.error) {
      document.getElementById("group-state").textContent = g.error;
      return;
    }
    const state = document.getElementById("group-state");
    state.textContent = "State: " + g.state + " · breaker " + g.breaker.state + " · limit " +
      g.limit + (g.adaptive ? " (adaptive)" : "") + " · " + num(g.msg_per_s) + " msg/s · lag " +
      num(g.lag) + (g.guard && g.guard.held ? " · guard held (" + g.guard.messages + " messages)" : "");
    state.className = "state " + stateClass(g.state);
    document.getElementById("group-detail").textContent = g.detail +
      (g.breaker.last_failure ? " · last failure: " + g.breaker.last_failure : "");
    fill(document.getElementById("partitions"), g.rows.map((p) => ({
      key: p.topic + "/" + p.partition,
      cells: [
        p.topic + "[" + p.partition + "]" + (p.tier ? " (tier " + p.tier + ")" : ""),
        num(p.committed),
        num(p.end),
        { text: num(p.lag), cls: "lag" },
        p.window + " / " + p.window_max + (p.calls ? " (" + p.calls + " calls)" : ""),
        p.oldest_call ? p.oldest_call.age_s.toFixed(1) + " s (offset " + p.oldest_call.offset + ")" +
          (p.oldest_call.note ? " " + p.oldest_call.note : "") : "-",
        { text: p.reasons.length ? p.reasons.join(", ") : (p.paused ? "yes" : "no"), cls: "reasons" },
        p.ack_state_bytes + " B",
      ],
    })));
    fill(document.getElementById("instances"), g.instances.map((i) => ({
      key: i.target,
      cells: [
        i.target,
        i.ejected ? "ejected" : "yes",
        i.serving === null ? "unknown" : (i.serving ? "serving" : "not serving"),
        num(i.in_flight),
        num(i.calls),
        i.latency_ms + " ms",
      ],
    })));
    fill(document.getElementById("tiers"), g.tiers.length ? g.tiers.map((t) => ({
      key: String(t.tier),
      cells: ["tier " + t.tier, t.topic, t.delay_ms + " ms", num(t.depth), when(t.next_due_ms)],
    })) : [{ key: "none", cells: ["none", "no retry tiers configured (delivery.retry_topics)", "", "", ""] }]);
    drawChart(g.history, g.time);
    const list = document.getElementById("lines");
    list.textContent = "";
    for (const [ts, level, text] of g.lines.slice().reverse()) {
      list.append(el("li", { class: level }, el("time", { text: when(ts * 1000) }), " " + level + " " + text));
    }
    if (!g.lines.length) list.append(el("li", { text: "No state change logged since the console started." }));
  }

  function drawChart(history, now) {
    const svg = document.getElementById("chart");
    while (svg.firstChild) svg.firstChild.remove();
    const span = 15 * 60;
    const x = (t) => Math.max(0, 600 - ((now - t) / span) * 600);
    const top = Math.max(1, ...history.map((h) => h[2]));
    const y = (v) => 110 - (v / top) * 100;
    for (let i = 0; i < history.length; i++) {
      const [t, breaker] = history[i];
      if (!breaker) continue;
      const next = i + 1 < history.length ? history[i + 1][0] : now;
      const r = document.createElementNS(SVG, "rect");
      r.setAttribute("x", x(t).toFixed(1));
      r.setAttribute("y", "0");
      r.setAttribute("width", Math.max(1, x(next) - x(t)).toFixed(1));
      r.setAttribute("height", "120");
      r.setAttribute("class", breaker === 2 ? "open" : "half");
      svg.append(r);
    }
    if (history.length) {
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("points", history.map((h) => x(h[0]).toFixed(1) + "," + y(h[2]).toFixed(1)).join(" "));
      line.setAttribute("class", "limit");
      svg.append(line);
    }
    for (const [value, label] of [[top, "limit " + top], [0, "0"]]) {
      const text = document.createElementNS(SVG, "text");
      text.setAttribute("x", "4");
      text.setAttribute("y", (value ? y(value) + 10 : 118).toFixed(1));
      text.textContent = label;
      svg.append(text);
    }
    const last = history[history.length - 1];
    const opened = history.filter((h) => h[1]).length;
    document.getElementById("chart-caption").textContent =
      "Concurrency limit (line, now " + (last ? last[2] : "-") + ") and breaker not closed (bands: " +
      opened + " of " + history.length + " samples), last 15 minutes";
  }

  // -- dead letters -----------------------------------------------------------------------

  function dlqQuery() {
    return new URLSearchParams(view.query);
  }

  function buildDlq(main) {
    const q = dlqQuery();
    main.append(el("h1", { text: "Dead letters of " + view.group }));
    main.append(el("p", { id: "dlq-summary" }));
    const form = el("form", { id: "filters", class: "filters" });
    form.append(
      el("label", { for: "f-status", text: "Status" }),
      el("input", { id: "f-status", name: "status", value: q.get("status") || "", list: "statuses", size: 22 }),
      el("datalist", { id: "statuses" }),
      el("label", { for: "f-reason", text: "Reason template" }),
      el("select", { id: "f-reason", name: "reason" }, el("option", { value: "", text: "any" })),
      el("label", { for: "f-since", text: "Since (UTC)" }),
      el("input", { id: "f-since", name: "since", type: "datetime-local", value: toLocalInput(q.get("since")) }),
      el("label", { for: "f-until", text: "Until (UTC)" }),
      el("input", { id: "f-until", name: "until", type: "datetime-local", value: toLocalInput(q.get("until")) }),
      el("button", { type: "submit", text: "Filter" }),
    );
    form.addEventListener("submit", applyFilters);
    main.append(form);
    main.append(table("by-status", "Counted by status (the records read)", ["Status", "Records"]));
    main.append(table("by-reason", "Counted by reason template", ["Reason template", "Records"]));
    main.append(el("h2", { text: "Merge command for this filter" }));
    main.append(el("pre", { class: "command" }, el("code", { id: "merge-command" })));
    main.append(el("p", { id: "merge-note", class: "detail" }));
    main.append(el("div", { id: "actions" }));
    main.append(table("records", "Newest records the filter selects",
      ["Time", "Origin", "Attempt", "Status", "Reason", "Key", "Value", "Headers"]));
  }

  function toLocalInput(ms) {
    if (!ms) return "";
    return new Date(Number(ms)).toISOString().slice(0, 16);
  }

  function fromLocalInput(text) {
    return text ? String(Date.parse(text + ":00Z")) : "";
  }

  function applyFilters(event) {
    event.preventDefault();
    const q = new URLSearchParams();
    const status = document.getElementById("f-status").value.trim();
    const reason = document.getElementById("f-reason").value;
    const since = fromLocalInput(document.getElementById("f-since").value);
    const until = fromLocalInput(document.getElementById("f-until").value);
    if (status) q.set("status", status);
    if (reason) q.set("reason", reason);
    if (since) q.set("since", since);
    if (until) q.set("until", until);
    location.hash = groupHref("dlq", view.group) + (q.toString() ? "?" + q.toString() : "");
  }

  async function pollDlq() {
    const name = view.group;
    const query = view.query;
    const d = await getJson("/console/api/groups/" + encodeURIComponent(name) + "/dlq?" + query);
    if (view.page !== "dlq" || view.group !== name || view.query !== query) return;
    const summary = document.getElementById("dlq-summary");
    if (d.pending) { summary.textContent = "Reading the DLQ… (" + d.pending + ")"; return; }
    if (d.error || d.missing) { summary.textContent = d.error || d.missing; return; }
    summary.textContent = d.topic + ": " + num(d.total) + " records held; read the newest " +
      num(d.scanned) + (d.complete ? " (all of them)" : " (not all: counts cover these)") +
      "; " + num(d.matching) + " match the filter.";
    summary.dataset.matching = String(d.matching);
    fill(document.getElementById("by-status"), d.by_status.map(([s, n]) => ({
      key: s, cells: [{ text: s || "(none)", href: groupHref("dlq", name) + "?status=" + encodeURIComponent(s) }, num(n)],
    })));
    fill(document.getElementById("by-reason"), d.by_reason.map(([r, n]) => ({
      key: r, cells: [r || "(none)", num(n)],
    })));
    const list = document.getElementById("statuses");
    list.textContent = "";
    for (const [s] of d.by_status) list.append(el("option", { value: s }));
    const select = document.getElementById("f-reason");
    const chosen = dlqQuery().get("reason") || "";
    const wanted = ["", ...d.by_reason.map(([r]) => r)];
    if (chosen && !wanted.includes(chosen)) wanted.push(chosen);
    const have = Array.from(select.options).map((o) => o.value);
    if (JSON.stringify(have) !== JSON.stringify(wanted)) {
      select.textContent = "";
      for (const r of wanted) select.append(el("option", { value: r, text: r || "any", selected: r === chosen }));
    }
    document.getElementById("merge-command").textContent = d.merge_command;
    document.getElementById("merge-note").textContent = d.merge_filters_reason
      ? "The reason filter is not part of the merge: a merge selects by status and time only."
      : "";
    renderActions(d);
    fill(document.getElementById("records"), d.records.map((r) => ({
      key: r.partition + "@" + r.offset,
      cells: [
        r.time || "-",
        r.origin,
        r.attempt,
        r.status,
        { text: r.reason, cls: "reason" },
        { text: r.key, cls: "value" },
        { text: r.value, cls: "value" },
        { text: r.headers.map(([k, v]) => k + "=" + v).join("; "), cls: "value" },
      ],
    })));
  }

  // -- actions (only with the admin token) -------------------------------------------------

  function renderActions(d) {
    const box = document.getElementById("actions");
    const on = d.actions && !!token();
    if (!on) { box.textContent = ""; box.dataset.on = ""; return; }
    if (box.dataset.on) return;
    box.dataset.on = "1";
    box.append(
      el("h2", { text: "Actions" }),
      el("button", { type: "button", id: "dry-run", text: "Merge dry run" }),
      el("button", { type: "button", id: "merge", text: "Merge…" }),
      el("label", { for: "purge-bound", text: "Purge" }),
      el("select", { id: "purge-bound" },
        el("option", { value: "merged", text: "records merged back" }),
        el("option", { value: "until", text: "records before Until" }),
        el("option", { value: "all", text: "every record" })),
      el("button", { type: "button", id: "purge", text: "Purge…" }),
      el("pre", { id: "job", class: "job", "aria-live": "polite" }),
    );
    document.getElementById("dry-run").addEventListener("click", () => mergeFlow(false));
    document.getElementById("merge").addEventListener("click", () => mergeFlow(true));
    document.getElementById("purge").addEventListener("click", purgeFlow);
  }

  function actionQuery(extra) {
    const q = new URLSearchParams(view.query);
    q.delete("reason");
    for (const [k, v] of Object.entries(extra)) q.set(k, v);
    return q.toString();
  }

  async function runJob(action, query) {
    const out = document.getElementById("job");
    const answer = await post("/admin/groups/" + encodeURIComponent(view.group) + "/dlq/" + action + "?" + query);
    let job = await answer.json();
    if (!answer.ok) { out.textContent = "Refused (" + answer.status + "): " + (job.error || ""); return null; }
    while (job.state === "running") {
      out.textContent = job.kind + ": running…\n" + job.progress.join("\n");
      await new Promise((resolve) => setTimeout(resolve, 1000));
      job = await getJson("/console/api/jobs/" + job.id);
    }
    out.textContent = job.kind + ": " + job.state + (job.error ? " (" + job.error + ")" : "") +
      "\n" + job.progress.join("\n");
    return job;
  }

  async function mergeFlow(forReal) {
    const dry = await runJob("merge", actionQuery({ dry_run: "1" }));
    if (!dry || dry.state !== "done" || !dry.result) return;
    const count = dry.result.selected - dry.result.deferred;
    const out = document.getElementById("job");
    out.dataset.count = String(count);
    out.textContent = "Dry run: would merge " + count + " of " + dry.result.in_range +
      " records into " + dry.result.target_topic + " (" + dry.result.skipped_merged + " merged before)";
    if (!forReal || !count) return;
    confirmAction("Merge " + count + " records into " + dry.result.target_topic + "?", async () => {
      const job = await runJob("merge", actionQuery({}));
      if (job && job.result) out.textContent += "\nMerged " + job.result.written + " records.";
    });
  }

  async function purgeFlow() {
    const bound = document.getElementById("purge-bound").value;
    const dry = await runJob("purge", actionQuery({ dry_run: "1", bound: bound }));
    if (!dry || dry.state !== "done" || !dry.result) return;
    const count = dry.result.to_delete;
    const out = document.getElementById("job");
    out.dataset.count = String(count);
    out.textContent = "Dry run: would delete " + count + " records (" + dry.result.bound + ")";
    if (!count) return;
    confirmAction("Delete " + count + " records from " + dry.result.topic + "? This cannot be undone.", async () => {
      const job = await runJob("purge", actionQuery({ bound: bound }));
      if (job && job.result) out.textContent += "\n" + job.result.result;
    });
  }

  function confirmAction(text, action) {
    pending = action;
    document.getElementById("confirm-text").textContent = text;
    document.getElementById("confirm").showModal();
    document.getElementById("confirm-no").focus();
  }

  function closeConfirm(go) {
    document.getElementById("confirm").close();
    const action = pending;
    pending = null;
    if (go && action) action();
  }

  // -- start ------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("signin").addEventListener("submit", signIn);
    document.getElementById("signout").addEventListener("click", signOut);
    document.getElementById("confirm-yes").addEventListener("click", () => closeConfirm(true));
    document.getElementById("confirm-no").addEventListener("click", () => closeConfirm(false));
    window.addEventListener("hashchange", navigate);
    getJson("/console/api/overview").then((o) => { overview = o; showSignin(); }).catch(() => {});
    navigate();
  });
})();
