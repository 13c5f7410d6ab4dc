package clusterconfig

import (
	_ "embed" // the types' source, whose comments are the reference
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"reflect"
	"strings"
)

//go:embed types.go
var typesSource []byte

// external are the types of other projects the configuration embeds: documented by name, not
// field by field, and left open in the schema.
var external = map[string]string{
	"k8s.io/kubelet/config/v1beta1.KubeletConfiguration":       "the kubelet's own `kubelet.config.k8s.io/v1beta1` KubeletConfiguration",
	"k8s.io/kube-proxy/config/v1alpha1.KubeProxyConfiguration": "kube-proxy's own `kubeproxy.config.k8s.io/v1alpha1` KubeProxyConfiguration",
	"k8s.io/apiserver/pkg/apis/audit/v1.Policy":                "the API server's `audit.k8s.io/v1` Policy",
	"k8s.io/apimachinery/pkg/runtime.RawExtension":             "the plugin's configuration object",
}

// doc is one documented struct type of the configuration.
type doc struct {
	name   string
	text   string
	fields []fieldDoc
}

type fieldDoc struct {
	name, typ, text string
	required        bool
	schema          map[string]any
}

// comments returns the doc comments of types.go's types ("Type") and fields ("Type.Field").
func comments() (map[string]string, error) {
	f, err := parser.ParseFile(token.NewFileSet(), "types.go", typesSource, parser.ParseComments)
	if err != nil {
		return nil, fmt.Errorf("parsing the types' source: %w", err)
	}
	out := map[string]string{}
	for _, decl := range f.Decls {
		g, ok := decl.(*ast.GenDecl)
		if !ok || g.Tok != token.TYPE {
			continue
		}
		for _, spec := range g.Specs {
			ts := spec.(*ast.TypeSpec)
			out[ts.Name.Name] = clean(g.Doc.Text())
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				continue
			}
			for _, fld := range st.Fields.List {
				for _, n := range fld.Names {
					out[ts.Name.Name+"."+n.Name] = clean(fld.Doc.Text())
				}
			}
		}
	}
	return out, nil
}

func clean(s string) string { return strings.Join(strings.Fields(s), " ") }

// reference walks the configuration's types from ClusterConfiguration, in order of appearance.
func reference() ([]doc, error) {
	text, err := comments()
	if err != nil {
		return nil, err
	}
	var docs []doc
	seen := map[reflect.Type]bool{}
	var visit func(t reflect.Type) error
	visit = func(t reflect.Type) error {
		if seen[t] {
			return nil
		}
		seen[t] = true
		d := doc{name: t.Name(), text: text[t.Name()]}
		var nested []reflect.Type
		var add func(t reflect.Type) error
		add = func(t reflect.Type) error {
			for i := range t.NumField() {
				sf := t.Field(i)
				tag := sf.Tag.Get("json")
				if tag == "-" {
					continue
				}
				name, opts, _ := strings.Cut(tag, ",")
				if sf.Anonymous && opts == "inline" {
					if err := add(sf.Type); err != nil {
						return err
					}
					continue
				}
				comment := text[t.Name()+"."+sf.Name]
				if comment == "" {
					return fmt.Errorf("field %s.%s has no doc comment", t.Name(), sf.Name)
				}
				if !strings.HasPrefix(comment, name+" ") {
					return fmt.Errorf("the doc comment of %s.%s does not start with its name %s", t.Name(), sf.Name, name)
				}
				typ, schema, sub := describe(sf.Type)
				if sub != nil {
					nested = append(nested, sub)
				}
				schema["description"] = comment
				switch name {
				case "apiVersion":
					schema["const"] = APIVersion
				case "kind":
					schema["const"] = Kind
				}
				d.fields = append(d.fields, fieldDoc{name: name, typ: typ, text: comment, required: !strings.Contains(opts, "omitempty"), schema: schema})
			}
			return nil
		}
		if err := add(t); err != nil {
			return err
		}
		docs = append(docs, d)
		for _, n := range nested {
			if err := visit(n); err != nil {
				return err
			}
		}
		return nil
	}
	if err := visit(reflect.TypeFor[ClusterConfiguration]()); err != nil {
		return nil, err
	}
	return docs, nil
}

// describe returns a field type's name in the reference, its schema, and the struct type of this
// package it refers to, if any.
func describe(t reflect.Type) (string, map[string]any, reflect.Type) {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if note, ok := external[t.PkgPath()+"."+t.Name()]; ok {
		return note, map[string]any{"type": "object"}, nil
	}
	switch t.Kind() {
	case reflect.String:
		return "string", map[string]any{"type": "string"}, nil
	case reflect.Bool:
		return "boolean", map[string]any{"type": "boolean"}, nil
	case reflect.Int32:
		return "integer", map[string]any{"type": "integer", "format": "int32"}, nil
	case reflect.Slice:
		name, items, sub := describe(t.Elem())
		return "list of " + name, map[string]any{"type": "array", "items": items}, sub
	case reflect.Map:
		name, values, sub := describe(t.Elem())
		return "map of string to " + name, map[string]any{"type": "object", "additionalProperties": values}, sub
	case reflect.Struct:
		return "[" + t.Name() + "](#" + strings.ToLower(t.Name()) + ")", map[string]any{"$ref": "#/$defs/" + t.Name()}, t
	}
	panic(fmt.Sprintf("clusterconfig reference: no description of %s", t)) // a type added to types.go without one
}

// Reference returns the reference documentation of the configuration (Markdown), generated from
// the types and their doc comments.
func Reference() ([]byte, error) {
	docs, err := reference()
	if err != nil {
		return nil, err
	}
	var b strings.Builder
	b.WriteString("<!-- Generated by `make clusterconfig-docs` from internal/clusterconfig/types.go. Do not edit. -->\n\n")
	fmt.Fprintf(&b, "# %s %s reference\n\n", APIVersion, Kind)
	b.WriteString("`berth init --config FILE`, `berth mini up --config FILE` and `berth config validate|show|diff` read this file. ")
	b.WriteString("Decoding is strict: an unknown field or a value of the wrong type is an error naming the field's path. ")
	b.WriteString("The JSON schema for editors is [clusterconfig.schema.json](clusterconfig.schema.json) (`berth config schema`).\n")
	for _, d := range docs {
		fmt.Fprintf(&b, "\n## %s\n\n%s\n\n| field | type | required | description |\n|---|---|---|---|\n", d.name, d.text)
		for _, f := range d.fields {
			req := ""
			if f.required {
				req = "yes"
			}
			fmt.Fprintf(&b, "| `%s` | %s | %s | %s |\n", f.name, f.typ, req, strings.ReplaceAll(f.text, "|", `\|`))
		}
	}
	return []byte(b.String()), nil
}

// Schema returns the configuration's JSON schema for editors, generated from the types and their
// doc comments.
func Schema() ([]byte, error) {
	docs, err := reference()
	if err != nil {
		return nil, err
	}
	defs := map[string]any{}
	for _, d := range docs {
		props := map[string]any{}
		var required []string
		for _, f := range d.fields {
			props[f.name] = f.schema
			if f.required {
				required = append(required, f.name)
			}
		}
		def := map[string]any{"type": "object", "description": d.text, "properties": props, "additionalProperties": false}
		if len(required) > 0 {
			def["required"] = required
		}
		defs[d.name] = def
	}
	schema := map[string]any{
		"$schema":     "https://json-schema.org/draft/2020-12/schema",
		"title":       APIVersion + " " + Kind,
		"$ref":        "#/$defs/" + Kind,
		"$defs":       defs,
		"description": defs[Kind].(map[string]any)["description"],
	}
	out, err := json.MarshalIndent(schema, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encoding the schema: %w", err)
	}
	return append(out, '\n'), nil
}
