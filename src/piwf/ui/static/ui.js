// piwf ui: live updates, with nothing but the browser's own EventSource and fetch.
//
// Each tab listens to /events (the console holds one run.watch on the host for all of
// them). When a change touches what this page shows (its <main data-watch>: a run id, or
// "*" for a listing), the page is fetched again and its <main> swapped in, keeping what
// was typed into its forms and where the cursor was. Nothing here builds HTML from data:
// the server renders (and escapes) every page.
(function () {
  "use strict";
  var main = document.getElementById("main");
  var live = document.getElementById("live");
  var lost = document.getElementById("host-lost");
  var fetching = false;
  var again = false;

  // data-watch: "*" (a listing of runs), "controllers" (resources and their child runs),
  // or one run's id. A change names the runs it touched (null: any may have) and whether
  // a controller resource changed.
  function concerns(change) {
    var watch = main.getAttribute("data-watch");
    if (!watch) return false;
    if (change.runs === null) return true;
    if (watch === "controllers") return change.resources || change.runs.length > 0;
    if (watch === "*") return change.runs.length > 0;
    return change.runs.indexOf(watch) >= 0;
  }

  function keyOf(el) {
    var box = el.closest("[id]");
    return (box ? box.id : "") + "|" + (el.form ? el.form.getAttribute("action") : "") + "|" + el.name;
  }

  function typed() {
    var kept = {};
    main.querySelectorAll("input[name], textarea[name], select[name]").forEach(function (el) {
      if (el.type === "hidden") return;
      // what was typed stays (a refused value too, shown again beside the reason)
      var changed = el.type === "checkbox" ? el.checked !== el.defaultChecked
        : el.tagName === "SELECT" ? !el.options[el.selectedIndex] || !el.options[el.selectedIndex].defaultSelected
        : el.value !== "";
      if (changed) kept[keyOf(el)] = el.type === "checkbox" ? el.checked : el.value;
    });
    return kept;
  }

  function restore(kept, focused) {
    main.querySelectorAll("input[name], textarea[name], select[name]").forEach(function (el) {
      var key = keyOf(el);
      if (Object.prototype.hasOwnProperty.call(kept, key)) {
        if (el.type === "checkbox") el.checked = kept[key]; else el.value = kept[key];
      }
      if (focused && key === focused.key) {
        el.focus();
        if (focused.start !== null && el.setSelectionRange) {
          try { el.setSelectionRange(focused.start, focused.end); } catch (e) { /* not a text input */ }
        }
      }
    });
  }

  function swap(html) {
    var doc = new DOMParser().parseFromString(html, "text/html");
    var fresh = doc.getElementById("main");
    if (!fresh) return;
    var kept = typed();
    var active = document.activeElement;
    var focused = active && main.contains(active) && active.name
      ? {key: keyOf(active), start: active.selectionStart === undefined ? null : active.selectionStart,
         end: active.selectionEnd === undefined ? null : active.selectionEnd}
      : null;
    var notice = main.querySelector(".notice");
    main.innerHTML = fresh.innerHTML;
    main.setAttribute("data-watch", fresh.getAttribute("data-watch") || "");
    main.setAttribute("data-version", fresh.getAttribute("data-version") || "");
    if (notice && !main.querySelector(".notice")) main.insertBefore(notice, main.firstChild);
    restore(kept, focused);
    var banner = doc.getElementById("host-lost");
    if (banner) lost.hidden = banner.hidden;
    document.title = doc.title;
  }

  function refresh() {
    if (fetching) { again = true; return; }
    fetching = true;
    fetch(window.location.href, {credentials: "same-origin", cache: "no-store"})
      .then(function (response) { return response.text(); })
      .then(swap)
      .catch(function () { /* the console is away: the stream says so */ })
      .then(function () {
        fetching = false;
        document.body.setAttribute("data-refreshed", String(Number(document.body.getAttribute("data-refreshed") || 0) + 1));
        if (again) { again = false; refresh(); }
      });
  }

  // From the version the page was read at: a change between the page's read and the
  // stream's start is told at once.
  var stream = new EventSource("/events?since=" + encodeURIComponent(main.getAttribute("data-version") || "") +
                               "&watch=" + encodeURIComponent(main.getAttribute("data-watch") || ""));
  var dropped = false;
  stream.onopen = function () {
    live.setAttribute("data-state", "on");
    if (dropped) { dropped = false; refresh(); } // what changed while the stream was down
  };
  stream.onerror = function () {
    live.setAttribute("data-state", "off");
    dropped = true;
  };
  stream.onmessage = function (message) {
    var change = JSON.parse(message.data);
    lost.hidden = change.host;
    if (concerns(change)) refresh();
  };
})();
