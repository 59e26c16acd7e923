/* k3lab's offline widget view: draws the ipywidgets saved with an exported notebook page (the
   application/vnd.jupyter.widget-state+json script nbclient stores) where each widget-view+json script
   stands, with no network and no kernel. Every control is drawn as the run left it (its value, label,
   options and outputs), read-only: moving it needs a live kernel (the notebook in JupyterLab).
   Output widgets draw their outputs: plotly figures with the page's own plotly.js, HTML, images, text.
   A widget kind not listed in VIEWS is drawn as a box that names it (class k3lab-widget-unsupported);
   a view whose model was not saved says so (class k3lab-widget-missing). When done, <body> carries
   data-k3lab-widgets="views=N drawn=N missing=N unsupported=N". */
(function () {
  "use strict";
  var STATE_MIME = "application/vnd.jupyter.widget-state+json";
  var VIEW_MIME = "application/vnd.jupyter.widget-view+json";
  var PLOTLY_MIME = "application/vnd.plotly.v1+json";
  var counts = { views: 0, drawn: 0, missing: 0, unsupported: 0 };
  var models = {};

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function ref(value) {  // "IPY_MODEL_<id>" -> the model's state, else null
    if (typeof value !== "string" || value.indexOf("IPY_MODEL_") !== 0) return null;
    var m = models[value.slice(10)];
    return m ? m.state : null;
  }
  function layout(e, s) {  // the few Layout traits that change what a reader sees
    var l = ref(s.layout);
    if (!l) return e;
    ["width", "height", "max_width", "min_width", "margin", "padding", "border", "justify_content",
     "align_items", "flex_flow", "grid_template_columns"].forEach(function (k) {
      if (l[k]) e.style[k.replace(/_([a-z])/g, function (_, c) { return c.toUpperCase(); })] = l[k];
    });
    if (l.display) e.style.display = l.display;
    if (l.visibility) e.style.visibility = l.visibility;
    return e;
  }
  function described(s, control) {  // a description label before a control, as ipywidgets draws it
    var row = layout(el("div", "k3w-row"), s);
    var st = ref(s.style) || {};
    if (s.description) {
      var label = el("label", "k3w-label");
      if (s.description_allow_html) label.innerHTML = s.description; else label.textContent = s.description;
      if (st.description_width) label.style.width = st.description_width === "initial" ? "auto"
        : st.description_width;
      if (s.description_tooltip || s.tooltip) label.title = s.description_tooltip || s.tooltip;
      row.appendChild(label);
    }
    row.appendChild(control);
    return row;
  }
  function fmt(value, format) {  // a slider's readout: ".2f", "d", ".3g" (the formats ipywidgets uses)
    if (typeof value !== "number") return String(value);
    var m = /\.(\d+)([fge%])/.exec(format || "");
    if (m) {
      var p = +m[1];
      if (m[2] === "f") return value.toFixed(p);
      if (m[2] === "e") return value.toExponential(p);
      if (m[2] === "%") return (100 * value).toFixed(p) + "%";
      return String(+value.toPrecision(Math.max(1, p)));
    }
    return format === "d" ? String(Math.round(value)) : String(value);
  }
  function attr(e, name, value) {  // as an attribute too, so a saved or dumped page keeps it
    e[name] = value;
    if (value === true) e.setAttribute(name, "");
    else if (value !== false && value !== null && value !== undefined) e.setAttribute(name, String(value));
    return e;
  }
  function disabled(e) {
    e.disabled = true;
    e.title = "as the run left it: with a running kernel (JupyterLab) this control is live";
    return e;
  }

  function slider(s, name) {
    var range = /Range/.test(name);
    var options = s._options_labels;
    var box = el("span", "k3w-slider");
    var input = disabled(el("input"));
    input.type = "range";
    if (options) {  // SelectionSlider: an index into the labels
      input.min = 0; input.max = options.length - 1; input.step = 1;
      attr(input, "value", range ? (s.index || [0])[0] : s.index);
    } else {
      var v = range ? s.value[0] : s.value;
      if (name === "FloatLogSliderModel") {
        input.min = s.min; input.max = s.max; input.step = "any";
        attr(input, "value", Math.log(v) / Math.log(s.base || 10));
      } else {
        input.min = s.min; input.max = s.max; input.step = s.step || "any"; attr(input, "value", v);
      }
    }
    box.appendChild(input);
    var shown;
    if (options) shown = range ? (s.index || []).map(function (i) { return options[i]; }).join(" - ")
      : options[s.index];
    else shown = range ? fmt(s.value[0], s.readout_format) + " - " + fmt(s.value[1], s.readout_format)
      : fmt(s.value, s.readout_format);
    if (s.readout !== false) box.appendChild(el("span", "k3w-readout", shown));
    return described(s, box);
  }
  function text(s, name) {
    var multi = name === "TextareaModel";
    var input = disabled(el(multi ? "textarea" : "input", "k3w-text"));
    if (!multi) input.type = name === "PasswordModel" ? "password" : (/Int|Float/.test(name) ? "number" : "text");
    if (multi) input.textContent = s.value === null || s.value === undefined ? "" : String(s.value);
    else attr(input, "value", s.value === null || s.value === undefined ? "" : String(s.value));
    if (s.placeholder) input.placeholder = s.placeholder;
    return described(s, input);
  }
  function choice(s, name) {
    var labels = s._options_labels || [];
    var picked = Array.isArray(s.index) ? s.index : [s.index];
    if (name === "RadioButtonsModel" || name === "ToggleButtonsModel") {
      var group = el("span", "k3w-choices");
      labels.forEach(function (label, i) {
        var b = el("span", "k3w-choice" + (picked.indexOf(i) >= 0 ? " k3w-picked" : ""), label);
        group.appendChild(b);
      });
      return described(s, group);
    }
    var select = disabled(el("select", "k3w-select"));
    if (name !== "DropdownModel") { select.multiple = name === "SelectMultipleModel"; select.size = s.rows || 5; }
    labels.forEach(function (label, i) {
      var o = el("option", "", label);
      attr(o, "selected", picked.indexOf(i) >= 0);
      select.appendChild(o);
    });
    return described(s, select);
  }
  function flag(s, name) {
    if (name === "ToggleButtonModel") return el("span", "k3w-button" + (s.value ? " k3w-picked" : ""),
      s.description || "");
    if (name === "ValidModel") return described(s, el("span", "k3w-valid", s.value ? "\u2714" : "\u2716"));
    var input = disabled(el("input"));
    input.type = "checkbox"; attr(input, "checked", !!s.value);
    var label = el("label", "k3w-row");
    label.appendChild(input);
    label.appendChild(el("span", "", s.description || ""));
    return layout(label, s);
  }
  function progress(s) {
    var p = el("progress", "k3w-progress");
    attr(p, "max", s.max - s.min); attr(p, "value", s.value - s.min);
    return described(s, p);
  }
  function box(s, name) {
    var b = layout(el("div", name === "HBoxModel" ? "k3w-hbox" : (name === "GridBoxModel" ? "k3w-grid" : "k3w-vbox")), s);
    (s.children || []).forEach(function (c) { b.appendChild(view(String(c).replace("IPY_MODEL_", ""))); });
    return b;
  }
  function titled(s) {  // Tab, Accordion, Stack: every child under its title (a page shows them all)
    var b = layout(el("div", "k3w-vbox"), s);
    var titles = s.titles || s._titles || {};
    (s.children || []).forEach(function (c, i) {
      b.appendChild(el("div", "k3w-title", titles[i] || titles[String(i)] || ""));
      b.appendChild(view(String(c).replace("IPY_MODEL_", "")));
    });
    return b;
  }
  function bytesImage(s, id) {
    var buffers = (models[id] && models[id].buffers) || [];
    var value = buffers.filter(function (b) { return b.path && b.path[0] === "value"; })[0];
    if (!value) return el("span", "k3w-note", "(image not saved with the page)");
    var img = layout(el("img"), s);
    var fmtName = s.format === "svg" ? "svg+xml" : (s.format || "png");
    img.src = "data:image/" + fmtName + ";base64," + value.data;
    if (s.width) img.width = s.width;
    if (s.height) img.height = s.height;
    return img;
  }

  var ANSI = /\u001b\[[0-9;]*m/g;
  function outputArea(outputs) {
    var area = el("div", "k3w-output");
    (outputs || []).forEach(function (o) {
      if (o.output_type === "stream") {
        area.appendChild(el("pre", o.name === "stderr" ? "k3w-stderr" : "", [].concat(o.text).join("")));
        return;
      }
      if (o.output_type === "error") {
        area.appendChild(el("pre", "k3w-stderr", (o.traceback || [o.ename + ": " + o.evalue]).join("\n")
          .replace(ANSI, "")));
        return;
      }
      area.appendChild(mimeBundle(o.data || {}));
    });
    return area;
  }
  function mimeBundle(data) {
    var join = function (v) { return [].concat(v).join(""); };
    if (data[VIEW_MIME]) return view(data[VIEW_MIME].model_id);
    if (data[PLOTLY_MIME]) {
      var fig = data[PLOTLY_MIME];
      if (typeof fig === "string") fig = JSON.parse(fig);
      var div = el("div", "k3w-plotly");
      if (window.Plotly) {
        window.Plotly.newPlot(div, fig.data || [], fig.layout || {}, { responsive: true });
      } else {
        div.className += " k3lab-widget-missing";
        div.textContent = "(plotly.js was not found beside this page: the figure is not drawn)";
      }
      return div;
    }
    if (data["text/html"]) { var h = el("div", "k3w-html"); h.innerHTML = join(data["text/html"]); return h; }
    if (data["image/svg+xml"]) { var v = el("div"); v.innerHTML = join(data["image/svg+xml"]); return v; }
    var raster = ["image/png", "image/jpeg", "image/gif"].filter(function (k) { return data[k]; })[0];
    if (raster) { var i = el("img"); i.src = "data:" + raster + ";base64," + join(data[raster]); return i; }
    if (data["text/markdown"]) return el("pre", "", join(data["text/markdown"]));
    if (data["text/latex"]) return el("pre", "", join(data["text/latex"]));
    return el("pre", "", join(data["text/plain"] || ""));
  }

  var VIEWS = {
    VBoxModel: box, HBoxModel: box, BoxModel: box, GridBoxModel: box,
    TabModel: titled, AccordionModel: titled, StackModel: titled,
    IntSliderModel: slider, FloatSliderModel: slider, FloatLogSliderModel: slider,
    IntRangeSliderModel: slider, FloatRangeSliderModel: slider, SelectionSliderModel: slider,
    SelectionRangeSliderModel: slider, PlayModel: slider,
    IntTextModel: text, FloatTextModel: text, BoundedIntTextModel: text, BoundedFloatTextModel: text,
    TextModel: text, TextareaModel: text, PasswordModel: text, ComboboxModel: text,
    DatePickerModel: text, ColorPickerModel: text, TimePickerModel: text, DatetimeModel: text,
    DropdownModel: choice, SelectModel: choice, SelectMultipleModel: choice, RadioButtonsModel: choice,
    ToggleButtonsModel: choice,
    CheckboxModel: flag, ToggleButtonModel: flag, ValidModel: flag,
    IntProgressModel: progress, FloatProgressModel: progress,
    ButtonModel: function (s) {
      return layout(disabled(el("button", "k3w-button", s.description || "")), s);
    },
    LabelModel: function (s) { return layout(el("span", "k3w-label-value", s.value), s); },
    HTMLModel: function (s) { var e = layout(el("div", "k3w-html"), s); e.innerHTML = s.value || ""; return described(s, e); },
    HTMLMathModel: function (s) { var e = layout(el("div", "k3w-html"), s); e.innerHTML = s.value || ""; return described(s, e); },
    OutputModel: function (s) { return layout(outputArea(s.outputs), s); },
    ImageModel: bytesImage
  };
  // the names of VIEWS, for the report's own check of what a page needs (k3lab.report.pages)
  window.k3labWidgetKinds = Object.keys(VIEWS);

  function view(id) {
    var m = models[id];
    var e;
    if (!m) {
      counts.missing += 1;
      return el("div", "k3lab-widget-missing", "(a widget whose state was not saved with this page: "
        + "run the notebook in JupyterLab to see it)");
    }
    var make = VIEWS[m.model_name];
    if (!make) {
      counts.unsupported += 1;
      return el("div", "k3lab-widget-unsupported", "(ipywidgets " + m.model_name
        + ": not drawn in this offline page; run the notebook in JupyterLab to see it)");
    }
    try {
      e = make(m.state || {}, m.model_name, id);
    } catch (err) {
      counts.unsupported += 1;
      return el("div", "k3lab-widget-unsupported", "(ipywidgets " + m.model_name + " could not be drawn: "
        + err + ")");
    }
    e.setAttribute("data-k3lab-model", m.model_name);
    return e;
  }

  function drawAll() {
    document.querySelectorAll('script[type="' + STATE_MIME + '"]').forEach(function (s) {
      try {
        var state = JSON.parse(s.textContent).state || {};
        Object.keys(state).forEach(function (k) { models[k] = state[k]; });
      } catch (err) {
        console.error("k3lab widgets: unreadable widget state: " + err);
      }
    });
    document.querySelectorAll('script[type="' + VIEW_MIME + '"]').forEach(function (s) {
      counts.views += 1;
      var spec;
      try { spec = JSON.parse(s.textContent); } catch (err) { spec = {}; }
      var before = counts.missing + counts.unsupported;
      var holder = el("div", "k3lab-widget");
      holder.appendChild(view(spec.model_id));
      if (counts.missing + counts.unsupported === before) counts.drawn += 1;
      s.parentNode.insertBefore(holder, s.nextSibling);
    });
    document.body.setAttribute("data-k3lab-widgets", "views=" + counts.views + " drawn=" + counts.drawn
      + " missing=" + counts.missing + " unsupported=" + counts.unsupported);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", drawAll);
  else drawAll();
})();
