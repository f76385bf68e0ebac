// flax-ln parity report: sorting and filtering the tensor tables (written into the page; nothing is loaded).
// Without JavaScript the page is the same tree and tables, unsorted and unfiltered.
(function () {
  "use strict";
  function cellValue(row, index, numeric) {
    var cell = row.cells[index];
    if (!numeric) { return cell.textContent; }
    var v = cell.getAttribute("data-v");
    if (v === null || v === "") { return -Infinity; }
    if (v === "nan") { return Infinity; }  // a NaN error sorts with the worst
    return v === "inf" ? Infinity : parseFloat(v);
  }
  function sortBy(table, header) {
    var index = header.cellIndex;
    var numeric = header.getAttribute("data-type") === "num";
    // the first click on a number sorts the largest (the worst error) first
    var descending = numeric ? !header.classList.contains("desc") : header.classList.contains("asc");
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) { th.classList.remove("asc", "desc"); });
    header.classList.add(descending ? "desc" : "asc");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = cellValue(a, index, numeric), y = cellValue(b, index, numeric);
      var order = numeric ? x - y : String(x).localeCompare(String(y));
      if (numeric && x === y) { order = 0; }
      return descending ? -order : order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
      th.addEventListener("click", function () { sortBy(table, th); });
    });
  });
  document.querySelectorAll("input.filter").forEach(function (input) {
    var table = document.getElementById(input.getAttribute("data-table"));
    input.addEventListener("input", function () {
      var needle = input.value.toLowerCase();
      Array.prototype.forEach.call(table.tBodies[0].rows, function (row) {
        var name = (row.getAttribute("data-name") || "").toLowerCase();
        row.style.display = name.indexOf(needle) === -1 ? "none" : "";
      });
    });
  });
}());
