// Live updates: one EventSource per page; the console sends each task's summary when
// the registry's watch streams say it moved. Cells marked data-field are rewritten.
(function () {
  "use strict";
  var live = document.querySelector("[data-live]");
  if (!live || !window.EventSource) { return; }
  var dot = document.getElementById("live");
  var source = new EventSource("/events");
  source.onopen = function () { if (dot) { dot.classList.add("on"); } };
  source.onerror = function () { if (dot) { dot.classList.remove("on"); } };
  source.addEventListener("task", function (message) {
    var row = JSON.parse(message.data);
    var holder = document.querySelector('[data-task="' + CSS.escape(row.task_id) + '"]');
    if (!holder) { return; }
    ["status", "progress", "rate", "dead", "stuck"].forEach(function (field) {
      var cell = holder.querySelector('[data-field="' + field + '"]');
      if (cell && cell.textContent !== String(row[field])) {
        cell.textContent = row[field];
        cell.classList.add("flash");
        setTimeout(function () { cell.classList.remove("flash"); }, 800);
      }
    });
    Object.keys(row.states || {}).forEach(function (state) {
      var cell = holder.querySelector('[data-state="' + state + '"]');
      if (cell) { cell.textContent = row.states[state]; }
    });
  });
})();
